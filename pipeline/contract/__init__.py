"""What crosses a process boundary: the request, token events, the prefill->decode hand-off, sampling
parameters, the engine config replicas and workers receive, the errors users see, and their one wire
encoding. The bottom room of ``pipeline``: it imports nothing of the rooms beside it."""

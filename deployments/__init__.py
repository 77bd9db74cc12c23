"""The serving rooms, the only package that may import ``ray``; it wraps ``stages/`` and adds nothing
to the numerics. Two rooms, one way: ``ray_serve`` (Ray Serve's plumbing) imports ``openai`` (the
OpenAI-compatible surface, which imports no Ray), never the reverse.
"""

"""The OpenAI-compatible surface without Ray: request and response schemas, parsing the HTTP input,
streaming and non-streaming responses, parallel sampling (``n``), the Responses API, the API key, and
the flow from a parsed request to the stages' token events.

It imports no Ray (``tests/test_import_graph.py`` holds it to that), so every part of it is tested in
one process with no cluster; the Ray Serve room (``deployments.ray_serve``) wires it to the stages.
"""

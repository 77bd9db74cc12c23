"""The Ray Serve plumbing: the stage deployments, the ingress (Serve's HTTP proxy or HAProxy), the
application graph, autoscaling policies, metrics exported to the Ray dashboard, tensor-parallel
actors, the node's KV block server, and ``strata serve``'s command line.

This package imports nothing itself: ``cli`` sets Ray's environment before ``ray`` is first imported.
Every module here that serves the OpenAI surface imports ``metrics``, which installs its exporters there.
"""

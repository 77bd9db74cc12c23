"""Ray Serve room: stage deployments, the OpenAI-compatible ingress, autoscaling policies, metrics.

The only package that may import ``ray``; it wraps ``stages/`` and adds nothing to the numerics.
"""

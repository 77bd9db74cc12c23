"""Bearer-token auth for the HTTP API (``strata serve --api-key``), as vLLM's ``--api-key``.

Every route but ``/health``, ``/ping``, ``/version`` and ``/metrics`` (what load balancers, Serve's own
probes and Prometheus scrapers call, open as in vLLM) needs ``Authorization: Bearer <key>``; anything else
is a 401 with an OpenAI-style body. The key itself never
leaves the CLI process: ``ray_serve.serve_flags`` takes it out of the environment and ``sys.argv`` as it reads it
(before Ray starts: Ray's processes inherit the one, and Ray records the other), the serve config carries
its SHA-256, replicas compare the SHA-256 of what a client sends against it with ``hmac.compare_digest``
(constant time), and error bodies never echo it.
"""

from __future__ import annotations

import hashlib
import hmac

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
DIGEST_ENV = "STRATA_API_KEY_SHA256"  # where a replica keeps the digest its middleware checks
CHALLENGE = {"WWW-Authenticate": "Bearer"}
UNAUTHORIZED = {"error": {"message": "missing or invalid API key: send Authorization: Bearer <key>",
                          "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


def key_digest(key: str) -> str:
    """What the serve config stores for a key (hex SHA-256)."""
    if not key or key != key.strip():
        raise ValueError("the API key must be non-empty, without surrounding whitespace")
    return hashlib.sha256(key.encode()).hexdigest()


def authorized(path: str, authorization: str | None, digest: str | None) -> bool:
    """Whether a request to ``path`` with this Authorization header may proceed (always, without a key)."""
    if digest is None or path in OPEN_PATHS:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    sent = hashlib.sha256(token.strip().encode()).hexdigest() if scheme.lower() == "bearer" and token.strip() else ""
    return hmac.compare_digest(sent.encode(), digest.encode())  # equal lengths whenever a token was sent

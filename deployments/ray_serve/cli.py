"""`strata serve`: start (or join) a Ray cluster, deploy the Strata application, serve until Ctrl-C. Its flags
and the config they make are ``serve_flags``'s.

A local cluster is bound to loopback: Ray's node IP is 127.0.0.1 (set through
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before Ray is imported: Ray reads it at import), the
dashboard and the HTTP ingress (HAProxy, or Serve's proxy) listen on 127.0.0.1. ``--address`` joins an existing cluster
instead (multi-node: blocks move between nodes through each node's host tier).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from strata.deployments.ray_serve.loopback import LOOPBACK_ENV
from strata.deployments.ray_serve.serve_flags import load_config


# Ray Serve's throughput-optimized path (read by every Serve process when it imports Serve, so set before
# Ray starts). Measured with `strata bench serve-overhead` (docs/measured.md): the replica's own HTTP
# port takes the proxy hop out of every streamed token. Replica logs stay on the console.
FAST_PATH_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_LOG_TO_STDERR": "1"}


LOCAL_DRAIN_ENV = ("RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S")


def _start_ray(args: argparse.Namespace) -> Any:
    if args.address is None:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # node IP 127.0.0.1 (read when ray is imported)
        os.environ[LOOPBACK_ENV] = "1"
        # Serve keeps a stopping proxy alive 30 s so an external load balancer can notice; a cluster we
        # start ourselves has none, and Ctrl-C should not hang for half a minute (overridable).
        for key in LOCAL_DRAIN_ENV:
            os.environ.setdefault(key, "2")
    if getattr(args, "fast_path", True):
        for key, value in FAST_PATH_ENV.items():
            os.environ.setdefault(key, value)
        if getattr(args, "direct_port", None) is not None:  # read by every Serve process at import
            os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] = str(args.direct_port)
            os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] = str(min(65535, args.direct_port + 1000))
        if args.address is None and getattr(args, "ingress", "serve-proxy") == "haproxy":
            _use_haproxy(args)
    import ray

    if args.address is not None:
        return ray.init(address=args.address)
    return ray.init(
        num_cpus=args.num_cpus or max(8, os.cpu_count() or 1),
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=args.dashboard_port,
        _metrics_export_port=args.metrics_port,
        runtime_env={"worker_process_setup_hook": "strata.deployments.ray_serve.loopback.bind_replica_servers_to_loopback"},
    )


def _use_haproxy(args: argparse.Namespace) -> None:
    """HAProxy on --port for the cluster about to start (``deployments.ray_serve.haproxy_ingress``), its files in a
    directory of this server's own (removed at shutdown); Serve's proxy, said in one line, if it cannot."""
    from strata.deployments.ray_serve.haproxy_ingress import HAPROXY_ENV, haproxy_env, why_not_haproxy

    if os.environ.get(HAPROXY_ENV) == "0":  # the user's own choice, as Ray spells it
        args.ingress = "serve-proxy"
        return
    args.haproxy_dir = Path(tempfile.mkdtemp(prefix="strata-hap-"))
    env = haproxy_env(args.haproxy_dir)
    os.environ.update(env)  # before this process imports Serve (the check below does), as in every other
    why = why_not_haproxy()
    if why is not None:
        print(f"strata: {why}; --port is served by Ray Serve's proxy", file=sys.stderr, flush=True)
        for key in env:
            os.environ.pop(key)
        shutil.rmtree(args.haproxy_dir, ignore_errors=True)
        args.ingress, args.haproxy_dir = "serve-proxy", None


def _auth_hint() -> str:
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return "dashboard auth: disabled (RAY_AUTH_MODE=disabled)"
    token = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return f"dashboard auth: send 'Authorization: Bearer <token>'; the token is in {token} (or $RAY_AUTH_TOKEN)"


def _direct_endpoints(proxy_port: int, wait_s: float = 20.0) -> list[str]:
    """The replicas' own HTTP addresses when Serve's direct ingress is on (none otherwise), once the
    ingress replicas run. Serve only exposes them through its controller, so a failure here just
    means none are printed."""
    if os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") != "1" and os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "1":
        return []
    try:
        import ray
        from ray.serve.context import _get_global_client

        controller = _get_global_client()._controller
        haproxy = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
        fallback_port = int(os.environ.get("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "8500")) if haproxy else None
        deadline = time.monotonic() + wait_s
        while True:
            # In HAProxy mode Serve names the replicas only to its proxy manager; to anyone else, HAProxy.
            groups = ray.get(controller.get_target_groups.remote(from_proxy_manager=haproxy), timeout=10)
            ports = {t.port for g in groups if str(getattr(g, "protocol", "")).endswith("HTTP")
                     for t in g.targets if t.port not in (None, proxy_port, fallback_port)}
            if ports or time.monotonic() > deadline:
                return [f"http://127.0.0.1:{p}" for p in sorted(ports)]
            time.sleep(0.5)
    except Exception:
        return []


def check_ports(args: argparse.Namespace) -> None:
    """Refuse, before any cluster starts, ports another program already listens on; settle the first
    direct-ingress port (a second server on the machine gets the next free one, not a collision)."""
    wanted = [(args.host, args.port, "--port")]
    if args.address is None:  # a cluster we start binds its dashboard and metrics here too
        wanted += [("127.0.0.1", args.dashboard_port, "--dashboard-port"), ("127.0.0.1", args.metrics_port, "--metrics-port")]
    if getattr(args, "direct_port", None) is not None:
        wanted.append(("127.0.0.1", args.direct_port, "--direct-port"))
    for host, port, flag in wanted:
        if not 0 < port < 65536:
            raise ValueError(f"{flag} {port} is not a TCP port (1-65535)")
        if not _port_free(host, port):
            raise ValueError(f"port {port} on {host} is in use; pick another with {flag}")
    if getattr(args, "fast_path", True) and getattr(args, "direct_port", None) is None:
        args.direct_port = next((p for p in range(DIRECT_PORT, DIRECT_PORT + 1000) if _port_free("127.0.0.1", p)),
                                DIRECT_PORT)


DIRECT_PORT = 30000  # Serve's first direct-ingress port


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def run(args: argparse.Namespace, default_model: Callable[[], Path] | None = None) -> int:
    config = load_config(args, default_model)  # a bad config fails before any cluster starts
    check_ports(args)
    context = _start_ray(args)
    from ray import serve

    from strata.deployments.ray_serve.app import build_app

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port},
                    logging_config={"enable_access_log": args.access_log})
        serve.run(build_app(config, access_log=args.access_log), name="strata", route_prefix="/", blocking=False)
        if not wait_until_healthy(args, config.startup_timeout_s, stop):
            return 0 if stop.is_set() else 1
        dashboard = getattr(context, "dashboard_url", None) or f"127.0.0.1:{args.dashboard_port}"
        print(f"Strata is serving {config.model_name} (from {config.model_dir})", flush=True)
        via = "HAProxy" if getattr(args, "haproxy_dir", None) is not None else "Ray Serve's proxy"
        print(f"  OpenAI endpoint: http://{args.host}:{args.port}/v1  ({via}, load-balanced)", flush=True)
        for url in _direct_endpoints(args.port):
            print(f"  Direct endpoint: {url}/v1  (an LLM/ingress replica's own port: no proxy hop)", flush=True)
        print(f"  Ray dashboard:   http://{dashboard}", flush=True)
        print(f"  Prometheus:      http://127.0.0.1:{args.metrics_port}/metrics", flush=True)
        print(f"  {_tool_calls_hint(config)}", flush=True)
        print(f"  {_auth_hint()}", flush=True)
        print("  Ctrl-C stops the server.", flush=True)
        stop.wait()
    finally:
        print("strata: shutting down", file=sys.stderr, flush=True)
        _quiet_shutdown()
        if getattr(args, "haproxy_dir", None) is not None:
            shutil.rmtree(args.haproxy_dir, ignore_errors=True)
    return 0


def wait_until_healthy(args: argparse.Namespace, timeout_s: float, stop: threading.Event) -> bool:
    """Poll /health until it is 200, saying on stderr what the server still waits for (the model loading,
    a stage starting) as it changes and every 15 s. False when Ctrl-C came first, when the model failed to
    load, or after ``timeout_s`` (then one error line): the banner is printed only for a server that answers."""
    import httpx

    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{host}:{args.port}/health"
    start, said, said_at = time.monotonic(), "", 0.0
    while not stop.is_set():
        elapsed = time.monotonic() - start
        try:
            response = httpx.get(url, timeout=5)
            if response.status_code == 200:
                return True
            body = response.json()
            if body.get("status") == "failed":  # the model did not load: no wait will fix that
                print(f"strata: error: {body.get('reason', 'the server failed to start')} (see the Ray dashboard's "
                      "Serve logs)", file=sys.stderr, flush=True)
                return False
            waiting = ", ".join(body.get("waiting_for") or [body.get("status", "?")])
        except (httpx.HTTPError, ValueError):
            waiting = "the HTTP proxy"
        if waiting != said or elapsed - said_at >= 15:
            print(f"strata: starting ({elapsed:.0f} s): waiting for {waiting}", file=sys.stderr, flush=True)
            said, said_at = waiting, elapsed
        if elapsed > timeout_s:
            print(f"strata: error: not ready after {timeout_s:.0f} s (waiting for {waiting}); see the Ray "
                  "dashboard's Serve logs", file=sys.stderr, flush=True)
            return False
        stop.wait(1.0)
    return False


def _tool_calls_hint(config: Any) -> str:
    """Which tool-call format answers are read in, or why tools are refused."""
    from transformers import AutoTokenizer

    from strata.pipeline.frontend.tools.formats import tool_format_for

    try:  # the replicas loaded it already; a banner line never stops a server that is up
        tok = AutoTokenizer.from_pretrained(config.model_dir, local_files_only=True)
    except Exception:
        return "Tool calls:      not shown (the tokenizer could not be read from this process)"
    if config.chat_template is not None:
        tok.chat_template = config.chat_template
    fmt = tool_format_for(config.tool_call_parser, tok)
    if fmt is None:
        return "Tool calls:      off (the chat template renders no tools: see --chat-template, --tool-call-parser)"
    return f"Tool calls:      {fmt.name}" + (" (the chat template's format)" if config.tool_call_parser == "auto" else "")


def _quiet_shutdown() -> None:
    """Stop Serve and Ray, quietly. Replicas stopped on purpose make Ray log their exit as errors, and Ray
    retries the controller's ``graceful_shutdown`` task after killing it ("Task ServeController.
    graceful_shutdown failed ... retries"): none of it is a fault, so the workers' and raylet's lines Ray
    forwards to this terminal are dropped until the cluster is down (they stay in Ray's log files). An
    exception still propagates."""
    import contextlib
    import logging

    import ray
    from ray import serve

    for name in ("ray", "ray.serve", "ray._private", "ray.util"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        try:
            serve.shutdown()
        finally:
            ray.shutdown()

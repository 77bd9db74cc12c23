"""`strata serve`: start (or join) a Ray cluster, deploy the Strata application, serve until Ctrl-C.

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
from strata.deployments.ray_serve.vllm_flags import add_vllm_arguments, vllm_dtype, vllm_engine_flags
from strata.pipeline.contract.config import json_object_flag
from strata.pipeline.frontend.reasoning import REASONING_FORMATS
from strata.pipeline.frontend.tools.formats import TOOL_FORMATS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_ref", nargs="?", metavar="MODEL", help="a checkpoint directory or a Hugging Face id in the "
                   "local cache (as `vllm serve MODEL`); the same as --model")
    p.add_argument("--model", help="checkpoint directory, or a Hugging Face id already in the local cache "
                                   "(default: the built-in tiny demo model)")
    p.add_argument("--config", type=Path, help="JSON serve config: engine knobs and per-stage replicas/autoscaling")
    p.add_argument("--model-name", "--served-model-name", dest="model_name", nargs="+", metavar="NAME",
                   help="the model id clients send, and any aliases after it (default: the Hugging Face id the "
                        "model was given as, else the directory name)")
    p.add_argument("--max-model-len", type=int, help="prompt + output tokens of one request (engine.max_model_len)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16", "half"),
                   help="weights and KV (engine.dtype; auto, the default: float32 on CPU, bfloat16 on CUDA; "
                        "half = float16)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"),
                   help="what the KV cache stores in every tier: auto (the model's dtype) or fp8 (e4m3 with "
                        "per-layer scales calibrated at load: half of bf16's bytes) (engine.kv_cache_dtype)")
    p.add_argument("--model-impl", choices=("auto", "strata", "vllm", "transformers"),
                   help="auto (default): Strata's model code where it has the architecture, else transformers' "
                        "modules with Strata's paged attention; strata (= vllm): never the fallback; transformers: "
                        "the fallback even where Strata has the architecture (engine.model_impl)")
    p.add_argument("--speculative-config", dest="speculative",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4} (engine.speculative)')
    p.add_argument("--tensor-parallel-size", "--tp", dest="tp", type=int,
                   help="tensor-parallel ranks of every decoder stage (engine.tp)")
    p.add_argument("--kv-cache-memory", metavar="SIZE",
                   help="device KV budget per rank, which sizes the block pool: a size (8GiB, 512MiB) or a share of "
                        "the memory the weights leave free (40%%; the rest is headroom) (engine.kv_cache_memory)")
    p.add_argument("--direct-port", type=int,
                   help="first port of the replicas' own HTTP endpoints (fast path; default: 30000, or the first "
                        "free port above it)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health, /ping, "
                                     "/version and /metrics (default: $STRATA_API_KEY; only its SHA-256 reaches the "
                                     "replicas). A key on the command line is visible to other users of this "
                                     "machine: prefer --api-key-file")
    p.add_argument("--api-key-file", type=Path, metavar="FILE",
                   help="read the API key from FILE ('-': standard input), its first line; the safe way to give it")
    p.add_argument("--tool-call-parser", choices=("auto", "none", *TOOL_FORMATS),
                   help="how answers are read for tool calls (default auto: the syntax the chat template writes)")
    p.add_argument("--reasoning-parser", choices=("auto", "none", *REASONING_FORMATS),
                   help="how chat answers' thinking is read apart as reasoning_content (default auto: <think> tags "
                        "where the chat template writes them)")
    p.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                   help="a Jinja chat template replacing the checkpoint's, as a file or inline (one that renders "
                        "tools enables them)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", help="join a running cluster (ray://host:port or auto) instead of starting one")
    p.add_argument("--dashboard-port", type=int, default=8265)
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics endpoint of this node")
    p.add_argument("--num-cpus", type=int, help="logical CPUs of a local cluster (default: max(8, cores))")
    p.add_argument("--access-log", action="store_true",
                   help="log one INFO line per request in every replica (off by default)")
    p.add_argument("--ingress", choices=("haproxy", "serve-proxy"), default="haproxy",
                   help="what serves --port in a cluster this command starts: haproxy (default; Ray Serve's HAProxy "
                        "mode: streams cross it in C, as fast as a replica's own port) or serve-proxy (Serve's "
                        "Python proxy actor). Without the HAProxy binary, or with --no-fast-path, serve-proxy")
    p.add_argument("--no-fast-path", dest="fast_path", action="store_false",
                   help="use Ray Serve's default request path instead of its throughput-optimized one (replicas "
                        "that serve HTTP themselves, user code on the replica's event loop, calls between "
                        "deployments over gRPC)")
    add_vllm_arguments(p)  # vLLM's flags: honoured, or refused in one line (``vllm_flags.FLAGS``)


def load_config(args: argparse.Namespace, default_model: Callable[[], Path] | None = None) -> Any:
    """The serve config from ``--config`` and the flags; ``default_model`` (the entry room's demo
    checkpoint) when neither names a model."""
    from strata.deployments.ray_serve.config import ServeConfig, check_tensor_parallel
    from strata.stages.preflight import check_checkpoint

    config = ServeConfig.from_file(args.config) if args.config else ServeConfig.from_dict({})
    asked_len = "max_model_len" in config.engine.model_fields_set or getattr(args, "max_model_len", None) is not None
    flags = {key: value for key in ("max_model_len", "dtype", "kv_cache_dtype", "model_impl", "tp", "kv_cache_memory",
                                    "speculative") if (value := getattr(args, key, None)) is not None}
    if flags.get("model_impl") == "vllm":  # vLLM's name for its own model code: Strata's here
        flags["model_impl"] = "strata"
    if "speculative" in flags:
        flags["speculative"] = json_object_flag("--speculative-config", flags["speculative"])
    if "dtype" in flags and vllm_dtype(flags["dtype"]) is None:  # auto: the device's default
        del flags["dtype"]
    elif "dtype" in flags:
        flags["dtype"] = vllm_dtype(flags["dtype"])
    flags.update(vllm_engine_flags(args))
    if flags:  # flags win over the JSON config, and are validated like it
        config = ServeConfig.from_dict({**config.to_dict(), "engine": {**config.engine.to_dict(), **flags}})
    ref = getattr(args, "model_ref", None)
    if ref is not None and args.model is not None and ref != args.model:
        raise ValueError(f"two models given: {ref} and --model {args.model}")
    if (ref or args.model) is not None:
        from strata.pipeline.models.model_source import is_hub_id, resolve_model_dir

        config.model_dir = str(resolve_model_dir(ref or args.model))
        if is_hub_id(ref or args.model) and config.model_name is None:  # named as asked for, not by its snapshot
            config.model_name = str(ref or args.model)
    if args.model_name:  # the first is the name; any others are aliases (else the config's stand)
        config.model_name = args.model_name[0]
        config.model_aliases = args.model_name[1:] or config.model_aliases
    if getattr(args, "tool_call_parser", None):
        config.tool_call_parser = args.tool_call_parser
    if getattr(args, "reasoning_parser", None):
        config.reasoning_parser = args.reasoning_parser
    if getattr(args, "chat_template", None) is not None:
        config.chat_template = _read_template(args.chat_template)
    key = _api_key(args)
    if key is not None:
        from strata.deployments.openai.api_key import key_digest

        config.api_key_sha256 = key_digest(key)
    if config.model_dir is None:
        if default_model is None:
            raise ValueError("no model: give --model or \"model_dir\" in the config")
        config.model_dir = str(default_model())
    check_checkpoint(config.model_dir, config.chat_template, config.engine.chat_template_timeout_s)
    check_tensor_parallel(config, config.model_dir)
    if config.engine.kv_cache_memory is not None:
        config.engine = _sized_kv_pool(config.engine, config.model_dir, getattr(args, "address", None))
    if asked_len:  # the default is a budget, not a request: only a length someone asked for is checked
        check_model_len(config.engine.max_model_len, config.model_dir)
    return config


def _api_key(args: argparse.Namespace) -> str | None:
    """The API key from ``--api-key-file``, ``--api-key`` or ``$STRATA_API_KEY``, taken out of this process's
    environment and ``sys.argv`` as it is read: Ray's processes inherit the environment (the raylet, every
    replica and worker would hold the raw key), and Ray records the driver's command line. Only the key's
    SHA-256 goes on."""
    env_key = os.environ.pop(API_KEY_ENV, None)
    flag = getattr(args, "api_key", None)
    path = getattr(args, "api_key_file", None)
    if flag is not None:
        sys.argv[:] = ["<redacted>" if arg == flag else arg.replace(flag, "<redacted>") for arg in sys.argv]
    if path is not None and flag is not None:
        raise ValueError("give one of --api-key and --api-key-file")
    if path is None:
        return flag if flag is not None else env_key
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    key = (text.splitlines() or [""])[0]
    if not key.strip():
        raise ValueError(f"--api-key-file: {path} holds no key")
    return key


def _sized_kv_pool(engine: Any, model_dir: str, address: str | None) -> Any:
    """The engine config with its KV budget turned into a block count, here, once: every replica then
    allocates the same pool, and the front door's length checks know its size. A share of free memory
    is measured on this machine, so joining a cluster it must be a size."""
    from strata.pipeline.contract.sizes import parse_budget
    from strata.pipeline.models.model_config import load_model_config
    from strata.stages.kv_budget import with_kv_budget

    if address and parse_budget(engine.kv_cache_memory)[1] is not None:
        raise ValueError("--kv-cache-memory as a share of free memory is measured on this machine; joining a "
                         "cluster (--address), give a size such as 8GiB")
    return with_kv_budget(engine, Path(model_dir), load_model_config(model_dir).text)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long to be a path (an inline template)
        return False


def _read_template(given: str | Path) -> str:
    """A template file's text, or the template itself when given inline (as vLLM takes either)."""
    path = Path(given)
    inline = isinstance(given, str) and ("{{" in given or "{%" in given) and not _is_file(path)
    try:
        text = given if inline else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    path = path if not inline else Path("the inline template")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: {path} is not a Jinja template (line {exc.lineno}: {exc.message})") from None
    return text


ALLOW_LONG_ENV = "STRATA_ALLOW_LONG_MAX_MODEL_LEN"  # as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN
API_KEY_ENV = "STRATA_API_KEY"  # as vLLM's VLLM_API_KEY


def check_model_len(max_model_len: int, model_dir: str) -> None:
    """Refuse, in one line, a ``max_model_len`` beyond the positions the model was trained for, unless
    ``STRATA_ALLOW_LONG_MAX_MODEL_LEN=1`` says the caller knows (positions past them are extrapolated)."""
    from strata.pipeline.models.model_config import load_model_config

    limit = load_model_config(model_dir).text.max_position_embeddings
    if max_model_len > limit and os.environ.get(ALLOW_LONG_ENV) != "1":
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings ({limit}, "
                         f"in its config.json); ask for at most that, or set {ALLOW_LONG_ENV}=1 to extrapolate")


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

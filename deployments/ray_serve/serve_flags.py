"""`strata serve`'s flags and the serve config they make: the JSON config, overridden by the flags (Strata's
own and vLLM's, ``vllm_flags``), checked against the checkpoint before anything starts (template, tensor
parallelism, the KV budget turned into blocks once, a ``max_model_len`` past the model's positions). The
API key is read here and taken out of the environment and ``sys.argv`` at once: only its digest goes on.
Nothing here imports Ray (``cli`` sets Ray's environment before it does)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

from strata.deployments.ray_serve.vllm_flags import add_vllm_arguments, vllm_dtype, vllm_engine_flags
from strata.pipeline.contract.config import json_object_flag
from strata.pipeline.frontend.generation_defaults import load_generation_defaults
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
    p.add_argument("--generation-config", metavar="auto|vllm|FOLDER",
                   help="default sampling (default auto: the checkpoint's generation_config.json gives a request's "
                        "default temperature, top_p, top_k, repetition_penalty and max_tokens; vllm: none)")
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
    from strata.deployments.ray_serve.config import ServeConfig, check_stage_engines, check_tensor_parallel
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
    if getattr(args, "generation_config", None):
        config.generation_config = args.generation_config
    if getattr(args, "enable_tokenizer_info_endpoint", None):
        config.enable_tokenizer_info_endpoint = True
    if config.model_dir:  # a bad file stops the command here, in one line, before anything starts
        load_generation_defaults(config.generation_config, Path(config.model_dir))
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
    check_stage_engines(config)
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

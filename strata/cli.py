"""The `strata` command line: make-tiny-model, generate, bench, plan, serve, build-kernels, ops, align, smoke.

The entry room: it only calls down into the rooms below (deployments, stages, pipeline, ...).
Results go to stdout (generated text, benchmark tables); logs and progress go to stderr.
Heavy rooms (Ray, the benchmarks) are imported when their command runs, so `strata --help`
stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from strata.pipeline.contract.config import EngineConfig, json_object_flag, read_json_object
from strata.pipeline.contract.errors import RequestFailed
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.models.gguf_source import GGUFError
from strata.pipeline.models.model_source import HUB_ID, ModelNotFound, resolve_model_dir
from strata.offline import load_engine
from strata.checkpoints.catalog import LLAVA_ARCHITECTURES, TINY_ARCHITECTURES, build_tiny
from strata.checkpoints.tiny_model import TinyModelSpec

log = logging.getLogger("strata")


# Packages only benchmarks, plots, load tests and the smoke check use: extras, not runtime dependencies.
OPTIONAL_PACKAGES = {"matplotlib": "bench", "locust": "bench", "openai": "bench", "psutil": "bench"}


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2, no traceback."""


def _add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-model", help="write a tiny random checkpoint of a real architecture")
    p.add_argument("--arch", choices=TINY_ARCHITECTURES, default="llava-llama",
                   help="a LLaVA over a decoder, a text-only LLM of a registered family, or a native-resolution or "
                        "anyres VLM (Kimi-K2.5, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, LLaVA-OneVision); the shape flags "
                        "apply to LLaVA only, the others use their family's tiny config")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=TinyModelSpec.hidden)
    p.add_argument("--layers", type=int, default=TinyModelSpec.layers)
    p.add_argument("--heads", type=int, default=TinyModelSpec.heads)
    p.add_argument("--kv-heads", type=int, default=TinyModelSpec.kv_heads)
    p.add_argument("--intermediate", type=int, default=TinyModelSpec.intermediate)
    p.add_argument("--image-size", type=int, default=TinyModelSpec.image_size)
    p.add_argument("--patch-size", type=int, default=TinyModelSpec.patch_size)
    p.set_defaults(func=_cmd_make_tiny_model)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    if args.arch in LLAVA_ARCHITECTURES and (args.hidden % args.heads or args.heads % args.kv_heads):
        raise CLIError("--hidden must be divisible by --heads, and --heads by --kv-heads")
    if args.arch in LLAVA_ARCHITECTURES and args.image_size % args.patch_size:
        raise CLIError("--image-size must be a multiple of --patch-size")
    spec = TinyModelSpec(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                         intermediate=args.intermediate, image_size=args.image_size, patch_size=args.patch_size)
    print(build_tiny(args.arch, args.out, seed=args.seed, spec=spec))
    return 0


def _add_make_demo_image(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-demo-image", help="write the deterministic demo PNG")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--size", type=int, default=64)
    p.set_defaults(func=_cmd_make_demo_image)


def _cmd_make_demo_image(args: argparse.Namespace) -> int:
    from strata.checkpoints.tiny_model import make_demo_image

    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(make_demo_image(args.out, args.size))
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt (and images) in this process")
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the built-in tiny demo model)")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="one user message, rendered with the model's chat template")
    text.add_argument("--raw-prompt", help="text passed to the tokenizer as is (no chat template)")
    p.add_argument("--image", action="append", default=[], type=Path, help="image file (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    _add_engine_config_args(p)
    p.set_defaults(func=_cmd_generate)


# Engine knobs a command line may set; a --config JSON file sets any of them, flags win over it.
_ENGINE_FLAGS: dict[str, type] = {
    "dtype": str, "kv_cache_dtype": str, "attention_backend": str, "compile": bool, "prefill_chunk_tokens": int, "max_model_len": int, "num_kv_blocks": int,
    "host_kv_blocks": int, "host_kv_dir": str, "disk_kv_blocks": int, "disk_kv_dir": str, "tp": int,
    "speculative": str,  # a JSON object, read by engine_config_from_args
}
_FLAG_NAMES = {"speculative": "--speculative-config"}  # vLLM's name where it differs from the key's


def _add_engine_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="JSON engine config (flat, or under an \"engine\" key)")
    for name, kind in _ENGINE_FLAGS.items():
        flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        if kind is bool:
            p.add_argument(flag, action="store_const", const=True, default=None,
                           help=f"engine config {name} (default {EngineConfig.model_fields[name].default})")
        else:
            p.add_argument(flag, type=kind, default=None, dest=name,
                           help=f"engine config {name} (default {EngineConfig.model_fields[name].default})")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Defaults, then the --config file, then explicit flags."""
    data: dict[str, Any] = {}
    if args.config is not None:
        try:
            raw = read_json_object(args.config)
        except ValueError as exc:
            raise CLIError(str(exc)) from exc
        data = raw.get("engine", raw)
    data.update({k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k) is not None})
    try:
        if isinstance(data.get("speculative"), str):
            data["speculative"] = json_object_flag("--speculative-config", data["speculative"])
        return EngineConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise CLIError(f"bad engine config: {exc}") from exc


def _resolve_model(model: Path | None) -> Path:
    if model is None:
        from strata.checkpoints.tiny_model import ensure_demo_model

        return ensure_demo_model()
    if model.is_dir() and not (model / "config.json").is_file():
        raise CLIError(f"{model} has no config.json: not a Hugging Face checkpoint directory")
    if not model.exists() and not HUB_ID.match(str(model)):
        raise CLIError(f"model directory {model} does not exist")
    try:  # a directory, a GGUF file, or a Hugging Face id already in the local cache
        return resolve_model_dir(model)
    except (ModelNotFound, GGUFError) as exc:
        raise CLIError(str(exc)) from None


def _read_images(paths: list[Path]) -> list[bytes]:
    out = []
    for path in paths:
        try:
            out.append(path.read_bytes())
        except OSError as exc:
            raise CLIError(f"cannot read image {path}: {exc.strerror or exc}") from exc
    return out


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.prompt is not None and not args.prompt.strip() and not args.image:
        raise CLIError("--prompt is empty")
    if args.raw_prompt is not None and not args.raw_prompt.strip():
        raise CLIError("--raw-prompt is empty")
    images = _read_images(args.image)
    model = _resolve_model(args.model)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )
    try:
        params.validate()
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    engine = load_engine(model, engine_config_from_args(args))  # a tp the model cannot split: ValueError
    request: dict[str, Any] = {"images": images, "params": params}
    if args.prompt is not None:
        request["prompt"] = args.prompt
    else:
        request["raw_prompt"] = args.raw_prompt
    try:
        for delta in engine.stream(**request):
            sys.stdout.write(delta)
            sys.stdout.flush()
    finally:
        engine.close()  # stops tensor-parallel workers
    sys.stdout.write("\n")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from strata.bench import add_bench_commands

    p = sub.add_parser("bench", help="benchmarks")
    add_bench_commands(p.add_subparsers(dest="bench_command", required=True))


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="plan device / host / disk memory from config.json alone (no weights needed)",
        description="Sizes are binary: K/KB/KiB = 2^10, G/GB/GiB = 2^30, T/TB/TiB = 2^40 bytes. "
        "Token counts take K = 1,000 and M = 1,000,000 (e.g. --context 1M). Exit 0 if it fits, 1 if not.",
    )
    p.add_argument("--model", required=True, type=Path, help="checkpoint directory containing config.json, the "
                   "config.json file, or a built-in shape: moe-1t (the 1T-parameter MoE Strata targets)")
    p.add_argument("--context", required=True, help="tokens per sequence: an integer, or with K (x1000) / M (x1000000), e.g. 128K, 1M")
    p.add_argument("--concurrency", default="1", help="sequences held at full context at once (default 1)")
    p.add_argument("--device-mem", default="80GiB", help="accelerator memory (default 80GiB)")
    p.add_argument("--host-mem", default="0", help="host RAM for the KV host tier (default 0)")
    p.add_argument("--disk", default="0", help="disk for the KV disk tier (default 0)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="weights and KV (default bfloat16: what strata serve uses on CUDA; on a CPU it serves "
                        "float32 unless told --dtype bfloat16)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default="auto",
                   help="what the KV cache stores: auto (--dtype) or fp8 (e4m3: one byte a value, in every tier)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk size in tokens")
    p.add_argument("--staging-blocks", type=int, default=64, help="device blocks reserved for staging host/disk KV")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the language stage (default 1); "
                   "--device-mem is then one rank's")
    p.add_argument("--nodes", type=int, default=1, help="nodes the ranks span (default 1); tp must be a multiple")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from strata.pipeline.contract.sizes import parse_size
    from strata.planning.memory_plan import format_plan, parse_count, plan_memory
    from strata.planning.model_shapes import BUILTIN_SHAPES

    config = args.model / "config.json" if args.model.is_dir() else args.model
    if str(args.model) in BUILTIN_SHAPES:
        config = args.model
    elif not config.is_file():
        raise CLIError(f"no config.json at {args.model}: pass a checkpoint directory or its config.json, "
                       f"or a built-in shape ({', '.join(BUILTIN_SHAPES)})")
    try:
        sizes = {name: parse_size(getattr(args, name)) for name in ("device_mem", "host_mem", "disk")}
        plan = plan_memory(
            config, parse_count(args.context), parse_count(args.concurrency), sizes["device_mem"], sizes["host_mem"],
            sizes["disk"], dtype=args.dtype, block_size=args.block_size, chunk_tokens=args.chunk_tokens,
            staging_blocks=args.staging_blocks, tp=args.tp, nodes=args.nodes, kv_cache_dtype=args.kv_cache_dtype,
        )
    except ValueError as exc:  # bad sizes / counts, and ModelConfigError for an unusable config.json
        raise CLIError(str(exc)) from exc
    print(format_plan(plan))
    return 0 if plan.fits else 1


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (Ray Serve)")
    from strata.deployments.serve_cli import add_arguments

    add_arguments(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from strata.deployments.serve_cli import run
    from strata.checkpoints.tiny_model import ensure_demo_model

    try:
        return run(args, default_model=ensure_demo_model)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc


def _add_build_kernels(sub: argparse._SubParsersAction) -> None:
    import strata.build_kernels as build_kernels
    from strata.commands import register

    register(sub, [("build-kernels", "compile the C++ CPU kernels now (install time), not on the first server start",
                    build_kernels)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Serve LLaVA-style models as a pipeline of stages.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (stderr)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_tiny_model(sub)
    _add_make_demo_image(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_plan(sub)
    _add_serve(sub)
    _add_build_kernels(sub)
    from strata.bringup import add_bringup_commands

    add_bringup_commands(sub)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from strata.kvstore import HandleError
    from strata.pipeline.models.model_config import ModelConfigError
    from strata.pipeline.models.weights import WeightsError

    errors: list[type[BaseException]] = [CLIError, ModelConfigError, WeightsError, HandleError, ValueError, OSError]
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except _user_errors() as exc:  # includes stages' ImageError (a ValueError)
        if args.verbose:
            log.exception("failed")
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = OPTIONAL_PACKAGES.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"strata: error: this command needs the optional package {exc.name.split('.')[0]}: "
              f"pip install 'strata[{extra}]'", file=sys.stderr)
        return 2
    except RequestFailed as exc:  # the request ran and failed (not the user's input): exit 1
        print(f"strata: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

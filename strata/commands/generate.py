"""`strata generate`: one prompt (and images) through the in-process engine, streamed to stdout; the engine
flags and ``--config`` every engine-running command takes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from strata.commands import CLIError
from strata.offline import load_engine
from strata.pipeline.contract.config import EngineConfig, json_object_flag, read_json_object
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.models.gguf_source import GGUFError
from strata.pipeline.models.model_source import HUB_ID, ModelNotFound, resolve_model_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    add_engine_config_args(p)


# Engine knobs a command line may set; a --config JSON file sets any of them, flags win over it.
_ENGINE_FLAGS: dict[str, type] = {
    "dtype": str, "kv_cache_dtype": str, "model_impl": str, "attention_backend": str, "compile": bool, "prefill_chunk_tokens": int, "max_model_len": int, "num_kv_blocks": int,
    "host_kv_blocks": int, "host_kv_dir": str, "disk_kv_blocks": int, "disk_kv_dir": str, "tp": int,
    "speculative": str,  # a JSON object, read by engine_config_from_args
}
_FLAG_NAMES = {"speculative": "--speculative-config"}  # vLLM's name where it differs from the key's


def add_engine_config_args(p: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
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

"""`strata plan`: device / host / disk memory for a model and a context, from config.json alone."""

from __future__ import annotations

import argparse
from pathlib import Path

from strata.commands import CLIError
from strata.pipeline.contract.config import EngineConfig

DESCRIPTION = ("Sizes are binary: K/KB/KiB = 2^10, G/GB/GiB = 2^30, T/TB/TiB = 2^40 bytes. "
               "Token counts take K = 1,000 and M = 1,000,000 (e.g. --context 1M). Exit 0 if it fits, 1 if not.")


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    engine = EngineConfig.model_fields  # the engine's own defaults, not copies of them
    p.add_argument("--block-size", type=int, default=engine["block_size"].default, help="tokens per KV block (default: the engine's, %(default)s)")
    p.add_argument("--chunk-tokens", type=int, default=engine["prefill_chunk_tokens"].default,
                   help="prefill chunk size in tokens (default: the engine's, %(default)s)")
    p.add_argument("--staging-blocks", type=int, default=engine["kv_staging_blocks"].default,
                   help="device blocks reserved for staging host/disk KV (default: the engine's, %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the language stage (default 1); "
                   "--device-mem is then one rank's")
    p.add_argument("--nodes", type=int, default=1, help="nodes the ranks span (default 1); tp must be a multiple")


def run(args: argparse.Namespace) -> int:
    from strata.pipeline.contract.sizes import parse_size
    from strata.planning.memory_plan import parse_count, plan_memory
    from strata.planning.plan_report import format_plan
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

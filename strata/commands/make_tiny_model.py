"""`strata make-tiny-model`: write a tiny random checkpoint of a real architecture (the catalog's names)."""

from __future__ import annotations

import argparse
from pathlib import Path

from strata.checkpoints.catalog import LLAVA_ARCHITECTURES, TINY_ARCHITECTURES, build_tiny
from strata.checkpoints.tiny_model import TinyModelSpec
from strata.commands import CLIError


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
    if args.arch in LLAVA_ARCHITECTURES and (args.hidden % args.heads or args.heads % args.kv_heads):
        raise CLIError("--hidden must be divisible by --heads, and --heads by --kv-heads")
    if args.arch in LLAVA_ARCHITECTURES and args.image_size % args.patch_size:
        raise CLIError("--image-size must be a multiple of --patch-size")
    spec = TinyModelSpec(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                         intermediate=args.intermediate, image_size=args.image_size, patch_size=args.patch_size)
    print(build_tiny(args.arch, args.out, seed=args.seed, spec=spec))
    return 0

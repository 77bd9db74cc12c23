"""`strata make-demo-image`: write the deterministic demo PNG."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--size", type=int, default=64)


def run(args: argparse.Namespace) -> int:
    from strata.checkpoints.tiny_model import make_demo_image

    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(make_demo_image(args.out, args.size))
    return 0

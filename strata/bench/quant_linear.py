"""`strata bench quant-linear`: one quantized linear on the CPU, the kernels against torch side by side.

For each row count of x and each format (FP8 128x128 blocks, INT4 groups of 32 with bf16 scales, MXFP4):
the path a weight takes in the engine (``quant_linear``: streamed up to 8 rows, the dequantizing GEMM up
to ``GEMM_ROWS``, tiles past it), the tile path alone (dequantize a tile to fp32, torch's GEMM), and
``F.linear`` on a dense fp32 weight of the same shape; and that dense weight through the engine's own path
(``kernels.linear``: streamed up to 8 rows, the same C++ GEMM up to its ``GEMM_ROWS``) against ``F.linear``.
Medians of calls, one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from strata.kernels.cpu_kernels import cpu_kernels
from strata.kernels.linear import linear
from strata.kernels.quant_linear import GEMM_ROWS, quant_linear, tiled_linear
from strata.kernels.quant_weight import FP8BlockWeight, Int4GroupWeight, MXFP4Weight, QuantWeight


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", type=int, nargs=2, default=[4096, 4096], metavar=("N", "K"),
                   help="W's rows (outputs) and columns (inputs)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 9, 16, 32, 64, 128, 256], help="rows of x")
    p.add_argument("--calls", type=int, default=9, help="timed calls per cell (median reported)")
    p.add_argument("--json", type=Path, help="also write the results here")


def random_weights(n: int, k: int, seed: int = 0) -> dict[str, QuantWeight]:
    """One weight of each format, random codes and scales (the kernels' speed does not depend on them)."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    fp8 = FP8BlockWeight(n, k, codes, torch.rand(-(-n // 128), -(-k // 128), generator=g) + 0.01, 128, 128)
    words = torch.randint(-2**31, 2**31 - 1, (n, -(-k // 8)), generator=g, dtype=torch.int64).to(torch.int32)
    int4 = Int4GroupWeight(n, k, words, (torch.rand(n, -(-k // 32), generator=g) + 0.05).to(torch.bfloat16), None, 32)
    mx = MXFP4Weight(n, k, torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
                     torch.randint(118, 134, (n, k // 32), generator=g, dtype=torch.uint8))
    return {"fp8": fp8, "int4": int4, "mxfp4": mx}


def median_ms(fn: Callable[[], object], calls: int) -> float:
    """Median wall time of ``calls`` calls of ``fn`` (after one warm-up call), in milliseconds."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(args: argparse.Namespace) -> int:
    if cpu_kernels() is None:
        raise RuntimeError("the CPU kernels could not be built here: nothing to compare")
    n, k = args.shape
    if k % 32:
        raise ValueError("--shape K must be a multiple of 32 (MXFP4's group)")
    weights = random_weights(n, k)
    dense = torch.randn(n, k)
    print(f"# strata bench quant-linear: W {n} x {k}, {torch.get_num_threads()} threads, medians of {args.calls} "
          f"calls; ms per call: engine path (streamed <= 8 rows, GEMM <= {GEMM_ROWS}, tiles past) / tile path / "
          f"fp32 F.linear; ratio = fp32 / engine path")
    print(f"{'rows':>5}" + "".join(f"{name:>34}" for name in weights) + f"{'fp32 (engine / F.linear)':>34}")
    results: list[dict[str, Any]] = []
    for m in args.rows:
        x = torch.randn(m, k)
        fp32 = median_ms(lambda: F.linear(x, dense), args.calls)
        cells = []
        for name, w in weights.items():
            engine = median_ms(lambda: quant_linear(x, w), args.calls)
            tiles = median_ms(lambda: tiled_linear(x, w), args.calls)
            cells.append(f"{engine:.2f} / {tiles:.2f} / {fp32:.2f} ({fp32 / engine:.2f}x)")
            results.append({"rows": m, "format": name, "engine_ms": engine, "tiles_ms": tiles, "fp32_ms": fp32})
        dense_engine = median_ms(lambda: linear(x, dense), args.calls)
        cells.append(f"{dense_engine:.2f} / {fp32:.2f} ({fp32 / dense_engine:.2f}x)")
        results.append({"rows": m, "format": "fp32", "engine_ms": dense_engine, "fp32_ms": fp32})
        print(f"{m:>5}" + "".join(f"{c:>34}" for c in cells), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"shape": [n, k], "results": results}, indent=1))
    return 0

"""`strata bench tp`: a tensor-parallel group against one process on the same cores, side by side.

Both engines are open at once and measured in interleaved rounds (medians reported): tp=1 is one
process with every thread; tp=N is N processes (this one the driver) with threads/N each, joined by
shared memory (gloo across nodes, NCCL on CUDA). Per round: TTFT of one prompt, and decode tokens/s of a batch
generating a fixed number of tokens (greedy, EOS ignored). The group's share of the decode wall time
spent inside collectives on the driver (all-reduces, the logits gather, step broadcasts; waiting for
the slower rank included) is the communication share. The two engines' tokens must be identical.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from strata.bench.offline import SIZES, bench_model_dir, random_prompts
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.stages.factory import build_engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(SIZES), default="small")
    p.add_argument("--tp", type=int, default=2, help="ranks of the group compared with one process")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores both sides use in all")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", type=Path)


def _side(engine: Any, threads: int, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """TTFT of the first prompt alone, then decode tok/s of the batch; returns the tokens too."""
    torch.set_num_threads(threads)
    group = getattr(engine.core.runner, "group", None)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate([{"prompt_token_ids": prompts[0], "params": one}])
    ttft = time.perf_counter() - t0
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    comm0 = group.comm_seconds if group is not None else 0.0
    t0 = time.perf_counter()
    outs = engine.generate([{"prompt_token_ids": p, "params": params} for p in prompts[1:]])
    wall = time.perf_counter() - t0
    comm = (group.comm_seconds - comm0) if group is not None else 0.0
    tokens = sum(len(o.output_token_ids) for o in outs)
    return {"ttft_s": ttft, "tok_s": tokens / wall, "comm_share": comm / wall, "ids": [o.output_token_ids for o in outs]}


def run(args: argparse.Namespace) -> int:
    if args.tp < 2 or args.threads < args.tp:
        raise ValueError(f"need --tp >= 2 and --threads >= --tp (got tp={args.tp}, threads={args.threads})")
    model = bench_model_dir(args.model)
    longest = args.prompt_len + args.output_len + 16
    base = dict(max_model_len=longest, dtype=args.dtype, max_num_seqs=max(args.batches), enable_prefix_caching=False)
    one = build_engine(model, EngineConfig(**base, num_threads=args.threads))
    group = build_engine(model, EngineConfig(**base, num_threads=args.threads // args.tp, tp=args.tp))
    transport = group.core.runner.group.transport
    print(f"# tp: {args.model} model ({args.dtype}), tp=1 (one process, {args.threads} threads) vs tp={args.tp} "
          f"({args.tp} processes x {args.threads // args.tp} threads, collectives over {transport}); "
          f"{args.prompt_len}-token prompts, {args.output_len} output tokens, greedy, EOS ignored; "
          f"medians of {args.repeats} interleaved rounds, fresh prompts per round")
    rows: list[dict[str, Any]] = []
    try:
        for batch in args.batches:
            runs: dict[str, list[dict[str, float]]] = {"tp1": [], "tpN": []}
            for r in range(args.repeats):
                prompts = random_prompts(batch + 1, args.prompt_len, 512, seed=1000 * batch + r)
                runs["tp1"].append(_side(one, args.threads, prompts, args.output_len))
                runs["tpN"].append(_side(group, args.threads // args.tp, prompts, args.output_len))
                if runs["tp1"][-1]["ids"] != runs["tpN"][-1]["ids"]:
                    print("strata: error: the group's tokens differ from one process's", file=sys.stderr)
                    return 1
            med = {side: {k: statistics.median(x[k] for x in v) for k in ("ttft_s", "tok_s", "comm_share")}
                   for side, v in runs.items()}
            rows.append({"batch": batch, "tp": args.tp, **{f"{s}_{k}": v for s, m in med.items() for k, v in m.items()}})
    finally:
        group.close()
    print(f"\n{'batch':>5}  {'tp1 tok/s':>10}  {f'tp{args.tp} tok/s':>10}  {'ratio':>6}  {'tp1 TTFT':>9}  "
          f"{f'tp{args.tp} TTFT':>9}  {'comm share':>10}")
    for row in rows:
        print(f"{row['batch']:>5}  {row['tp1_tok_s']:>10.1f}  {row['tpN_tok_s']:>10.1f}  "
              f"{row['tpN_tok_s'] / row['tp1_tok_s']:>5.2f}x  {row['tp1_ttft_s'] * 1000:>7.1f}ms  "
              f"{row['tpN_ttft_s'] * 1000:>7.1f}ms  {row['tpN_comm_share']:>9.1%}")
    print("tokens identical on both sides in every round")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0

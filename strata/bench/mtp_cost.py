"""`strata bench mtp`: what an MTP draft costs a decode step, and the acceptance rate at which it pays.

An MTP layer's speed-up is (1 + acceptance) tokens per step over the cost of a step that runs the layer
and verifies a two-row chunk. The acceptance belongs to the trained weights (DeepSeek reports 85-90% for
its MTP module on V3); random tiny weights accept almost nothing, so this benchmark measures the other
half: decode with MTP on against plain decoding, side by side in one process, rounds interleaved, on a
tiny DeepSeek-V3 built here with an MTP layer (``--layers`` decoder layers deep, since the layer's share of
a step is 1 / (layers + 1)). It prints the cost ratio of a step and the break-even acceptance (the
ratio minus one), and checks that greedy answers are identical, or the comparison is void.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from strata.pipeline.contract.sampling_params import SamplingParams

PROMPTS = ("the lighthouse stood on the northern cape for two hundred years", "one two three four five six",
           "every night its keeper climbed the ninety steps and trimmed the wick")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=12, help="decoder layers of the tiny DeepSeek-V3 built here")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)


def _decode(engine: Any, batch: int, max_tokens: int) -> tuple[list[list[int]], float, int]:
    """Answers, seconds and engine steps for ``batch`` greedy requests of ``max_tokens`` each."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [{"prompt": PROMPTS[i % len(PROMPTS)] + f" {i}", "params": params} for i in range(batch)]
    steps = engine.core.steps
    t0 = time.perf_counter()
    out = engine.generate(requests)
    return [o.output_token_ids for o in out], time.perf_counter() - t0, engine.core.steps - steps


def run(args: argparse.Namespace) -> int:
    from strata.checkpoints.mtp_layer import add_mtp_layer
    from strata.checkpoints.tiny_text_models import build_tiny_text_model
    from strata.pipeline.contract.config import EngineConfig
    from strata.stages.factory import build_engine

    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with tempfile.TemporaryDirectory(prefix="strata-mtp-") as tmp:
        model = add_mtp_layer(build_tiny_text_model("deepseek_v3", Path(tmp) / "ds",
                                                    overrides={"num_hidden_layers": args.layers}))
        engines = {"plain": build_engine(model, EngineConfig()),
                   "mtp": build_engine(model, EngineConfig(speculative=spec))}
        print(f"# mtp: tiny DeepSeek-V3 ({args.layers} layers + 1 MTP layer, fp32, {torch.get_num_threads()} "
              f"threads), greedy, {args.max_tokens} tokens per request; speculative config {json.dumps(spec)}; "
              f"medians of {args.rounds} interleaved rounds")
        for engine in engines.values():
            _decode(engine, 1, 4)
        rows: dict[str, dict[str, float]] = {}
        for batch in args.batch:
            seconds: dict[str, list[float]] = {side: [] for side in engines}
            steps: dict[str, int] = {}
            answers: dict[str, list[list[int]]] = {}
            before = engines["mtp"].core.speculation.to_dict()
            for _ in range(args.rounds):
                for side, engine in engines.items():
                    answers[side], took, steps[side] = _decode(engine, batch, args.max_tokens)
                    seconds[side].append(took)
            if answers["plain"] != answers["mtp"]:
                raise SystemExit(f"batch {batch}: greedy answers differ with MTP on: the comparison is void")
            after = engines["mtp"].core.speculation.to_dict()
            drafted, accepted = after["drafted"] - before["drafted"], after["accepted"] - before["accepted"]
            tokens = batch * args.max_tokens
            plain, mtp = statistics.median(seconds["plain"]), statistics.median(seconds["mtp"])
            step_ratio = (mtp / steps["mtp"]) / (plain / steps["plain"])
            rows[f"batch {batch}"] = r = {
                "plain_tok_s": tokens / plain, "mtp_tok_s": tokens / mtp, "acceptance": accepted / max(drafted, 1),
                "step_cost_ratio": step_ratio, "break_even_acceptance": step_ratio - 1}
            print(f"batch {batch:2d}: plain {r['plain_tok_s']:7.1f} tok/s  mtp {r['mtp_tok_s']:7.1f} tok/s "
                  f"(acceptance {r['acceptance']:.0%}, random weights)  a step with MTP costs {step_ratio:.2f}x "
                  f"a plain one: it pays above {r['break_even_acceptance']:.0%} acceptance  (answers identical)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0

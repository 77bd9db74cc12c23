"""`strata bench step`: one forward per step against the decode-then-prefill pair it replaced.

The aggregated engine runs every decode token and the prefill chunks that fit the step's budget in
one forward over one pool (one scheduler). Before, it ran two engine cores over that pool: a decode
forward, then a prefill forward in the rest of the budget, with the prefilled sequence handed from one
core to the other. This runs the same staggered workload through both, in interleaved rounds on the
same loaded model: requests arrive ``--arrival-steps`` steps apart, so most steps mix decodes with a
prefill chunk, as a serving replica's steps do. Reported: wall time, output tokens/s, forwards per
step, and median step time; in fp32 the tokens of both paths are checked equal (greedy); in bf16,
where rounding follows the batch's shape, the share of equal tokens is printed. ``--profile`` instead
splits a decode step's time by what it is spent on (``step_profile``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from strata.bench.offline import bench_model_dir, random_prompts
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.request import TokenEvent
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.sequence import Sequence

VOCAB = 500


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("tiny", "small", "smollm2"), default="small",
                   help="a tiny or small built model, or the real SmolLM2-135M-Instruct")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--arrival-steps", type=int, default=4, help="steps between two arrivals")
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk tokens")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--profile", action="store_true",
                   help="instead: split a decode step's time (linears, attention, norms, sampling, Python, ...) at "
                        "each --batch size")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="--profile: decode batch sizes")
    p.add_argument("--steps", type=int, default=32, help="--profile: decode steps timed per batch size")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="--profile: sampling temperature of the decoding requests (0: greedy; served clients "
                        "that send none sample at 1)")
    p.add_argument("--weights", choices=("fp8", "int4", "mxfp4"),
                   help="with --model smollm2: its copy in that release format, as `strata bench quant` writes it")


class _TwoCores:
    """The composition this replaced: a decode core, then a prefill core, each with its own forward."""

    def __init__(self, model: Path, config: EngineConfig) -> None:
        from strata.stages.decoder import Decoder
        from strata.stages.factory import LanguageStage
        from strata.stages.prefiller import Prefiller

        stage = LanguageStage(model, config)
        self.config, self.block_size = config, config.block_size
        self.prefiller, self.decoder = Prefiller(stage.core()), Decoder(stage.core())
        self.prefiller.set_admission_watermark(lambda: self.decoder.num_running)
        self.forwards = 0

    def add(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        self.prefiller.add(Sequence(rid, ids, params, self.block_size))

    def busy(self) -> bool:
        return self.prefiller.has_work() or self.decoder.has_work()

    def step(self) -> list[TokenEvent]:
        events = self.decoder.step(self.config.max_num_batched_tokens)
        self.forwards += bool(self.decoder.last_num_tokens)
        budget = self.config.max_num_batched_tokens - self.decoder.last_num_tokens
        if budget > 0:
            for result in self.prefiller.step(budget):
                if result.kv_handle is not None:
                    self.decoder.admit(result.seq, result.kv_handle)
                events.append(result.event)
            self.forwards += bool(self.prefiller.last_num_tokens)
        return events


class _OneForward:
    def __init__(self, model: Path, config: EngineConfig) -> None:
        from strata.stages.factory import build_engine

        self.engine = build_engine(model, config)
        self.forwards = 0

    def add(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        self.engine.add_request(prompt_token_ids=ids, params=params, request_id=rid)

    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[TokenEvent]:
        events = self.engine.step()
        self.forwards += bool(self.engine.last_step_tokens)
        return events


def _run(side: Any, prompts: list[list[int]], args: argparse.Namespace, tag: str) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    step_ms: list[float] = []
    side.forwards, steps, sent = 0, 0, 0
    t0 = time.perf_counter()
    while sent < len(prompts) or side.busy():
        if sent < len(prompts) and steps % args.arrival_steps == 0:
            side.add(f"{tag}-{sent}", prompts[sent], params)
            sent += 1
        t = time.perf_counter()
        for ev in side.step():
            tokens.setdefault(ev.request_id.split("-", 1)[1], []).append(ev.token_id)
        step_ms.append((time.perf_counter() - t) * 1e3)
        steps += 1
    wall = time.perf_counter() - t0
    out = sum(len(v) for v in tokens.values())
    return {"wall_s": wall, "tok_s": out / wall, "forwards_per_step": side.forwards / steps,
            "step_ms_p50": statistics.median(step_ms), "tokens": tokens}


def run(args: argparse.Namespace) -> int:
    if args.model == "smollm2":
        from strata.checkpoints.gguf_checkpoint import ensure_smollm2

        model = ensure_smollm2()
        if args.weights is not None:
            from strata.bench.quant import quantized_copy

            model = quantized_copy(model, args.weights)
    elif args.weights is not None:
        print("strata bench step: --weights takes --model smollm2", file=sys.stderr)
        return 2
    else:
        model = bench_model_dir(args.model)
    if args.profile:
        from strata.bench.step_profile import run_profile

        rows = run_profile(args, model)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    config = dict(dtype=args.dtype, prefill_chunk_tokens=args.chunk, max_num_batched_tokens=args.chunk + args.requests,
                  max_num_seqs=args.requests, max_model_len=args.prompt_len + args.output_len + 16,
                  enable_prefix_caching=False)
    prompts = random_prompts(args.requests, args.prompt_len, VOCAB, seed=1)
    sides = {"one forward per step": _OneForward(model, EngineConfig(**config)),
             "decode, then prefill": _TwoCores(model, EngineConfig(**config))}
    print(f"# step: {args.model} model ({args.dtype}, {torch.get_num_threads()} threads), {args.requests} requests "
          f"of {args.prompt_len} prompt + {args.output_len} output tokens, one every {args.arrival_steps} steps, "
          f"{args.chunk}-token chunks; medians of {args.rounds} interleaved rounds")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, side in sides.items():
            results[name].append(_run(side, prompts, args, f"r{r}"))
    one_run, two_run = (results[name][0]["tokens"] for name in sides)
    if one_run != two_run:
        if args.dtype == "float32":  # fp32 is exact here: different tokens would mean a bug, not noise
            raise SystemExit("the two paths produced different tokens: the comparison is void")
        same = sum(a == b for rid in one_run for a, b in zip(one_run[rid], two_run.get(rid, [])))
        print(f"# bf16: {same} of {sum(map(len, one_run.values()))} tokens equal (bf16 rounding depends on "
              "the batch's shape; both paths produce the same number of tokens)")
    rows = {}
    for name, runs in results.items():
        rows[name] = {k: statistics.median(run[k] for run in runs) for k in ("wall_s", "tok_s", "forwards_per_step",
                                                                             "step_ms_p50")}
        row = rows[name]
        print(f"{name:<22} {row['wall_s']:7.2f} s  {row['tok_s']:7.1f} tok/s  {row['forwards_per_step']:.2f} "
              f"forwards/step  step p50 {row['step_ms_p50']:.1f} ms")
    one, two = rows["one forward per step"], rows["decode, then prefill"]
    print(f"one forward / two: {one['tok_s'] / two['tok_s']:.2f}x tok/s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0

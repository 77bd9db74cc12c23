"""`strata bench kv`: what the tiered KV store buys, measured side by side in one run.

1. ttft   - time to first token of a long prompt that shares most of its tokens with an
            earlier one: cold recompute vs the shared prefix on the device, in the host tier
            (a fresh engine: new device pool, host files kept) and on disk (host tier off).
2. decode - decode step time and device bytes as the context grows with a fixed device tier
            (older blocks stream from the host tier): time should grow linearly, bytes stay flat.
3. max    - the largest context served end to end (prefill + a few tokens) within a time
            budget, doubling the context until the next one would not fit the budget.
Only ratios from the same run mean something on this shared, noisy machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from strata.bench.offline import SIZES, bench_model_dir, random_prompts
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.stages.factory import build_engine

VOCAB = 512


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", nargs="+", choices=("ttft", "decode", "max"), default=["ttft", "decode", "max"])
    p.add_argument("--model", choices=sorted(SIZES), default="small", help="model for the TTFT part")
    p.add_argument("--prompt-len", type=int, default=16_384, help="TTFT prompt length")
    p.add_argument("--shared", type=float, default=0.9, help="fraction of the TTFT prompt shared with the earlier one")
    p.add_argument("--repeats", type=int, default=3, help="cached TTFT runs per tier (median reported)")
    p.add_argument("--contexts", nargs="+", type=int, default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--device-blocks", type=int, default=128, help="device tier for the decode/max parts (blocks of 16)")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=600.0, help="time budget of one end-to-end run (max part)")
    p.add_argument("--max-start", type=int, default=65_536, help="first context tried by the max part")
    p.add_argument("--max-device-blocks", type=int, default=4096, help="device tier of the max part (blocks of 16)")
    p.add_argument("--max-chunk", type=int, default=4096, help="prefill chunk of the max part (each chunk streams the spilled context once)")
    p.add_argument("--workdir", type=Path, help="where the host/disk tiers live (default: a temp dir)")
    p.add_argument("--json", type=Path, help="also write the results here")


def _ttft(engine: Any, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate([{"prompt_token_ids": prompt, "params": params}])
    return time.perf_counter() - t0


def _flops(model: Path, first: int, end: int) -> float:
    """Forward FLOPs of positions [first, end): 2 x params per token, plus QK and PV over every
    visible key (what a cached prefix cannot save: the suffix still attends to all of it)."""
    from strata.pipeline.models.model_config import load_model_config

    t = load_model_config(model).text
    per_token = 2 * (t.num_layers * (2 * t.hidden_size * t.num_heads * t.head_dim
                                     + 2 * t.hidden_size * t.num_kv_heads * t.head_dim
                                     + 3 * t.hidden_size * t.intermediate_size) + t.hidden_size * t.vocab_size)
    keys = (end * (end + 1) - first * (first + 1)) / 2  # sum of (p + 1) over the positions computed
    return per_token * (end - first) + 4 * t.num_layers * t.num_heads * t.head_dim * keys


def _ttft_bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = bench_model_dir(args.model)
    n = args.prompt_len
    shared = int(n * args.shared)
    base = random_prompts(1, n, VOCAB, seed=11)[0]
    later = [base[:shared] + p for p in random_prompts(args.repeats + 1, n - shared, VOCAB, seed=12)]
    blocks = -(-n // 16) * 2 + 64
    common = dict(max_model_len=n + 64, num_kv_blocks=blocks)
    tiers = {
        "device": dict(),
        "host": dict(host_kv_blocks=blocks, host_kv_dir=str(work / "host")),
        "disk": dict(disk_kv_blocks=blocks, disk_kv_dir=str(work / "disk")),
    }
    cold = build_engine(model, EngineConfig(enable_prefix_caching=False, **common))
    warmup = random_prompts(1, 64, VOCAB, seed=99)[0]  # shares no block with the measured prompts
    _ttft(cold, warmup)
    out: dict[str, Any] = {"prompt_len": n, "shared_tokens": shared, "cold_s": _ttft(cold, later[0])}
    out["ideal_speedup"] = _flops(model, 0, n) / _flops(model, shared // 16 * 16, n)
    print(f"cold recompute            {out['cold_s']:8.2f} s   (FLOP bound for a cached prefix: "
          f"{out['ideal_speedup']:.1f}x, attention to the whole context included)", flush=True)
    del cold
    for name, extra in tiers.items():
        writer = build_engine(model, EngineConfig(**common, **extra))
        _ttft(writer, base)  # the earlier request: its blocks land on the device and are written through
        reader = writer if name == "device" else build_engine(model, EngineConfig(**common, **extra))
        _ttft(reader, warmup)
        times = [_ttft(reader, p) for p in later[1:]]
        out[f"{name}_s"] = statistics.median(times)
        out[f"{name}_speedup"] = out["cold_s"] / out[f"{name}_s"]
        print(f"prefix on {name:<6}          {out[f'{name}_s']:8.3f} s   {out[f'{name}_speedup']:6.1f}x faster than cold", flush=True)
        del writer, reader
    return out


def _decode_bench(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    model = bench_model_dir("tiny")
    longest = max(args.contexts)
    config = EngineConfig(
        max_model_len=longest + args.decode_steps + 64, num_kv_blocks=args.device_blocks,
        host_kv_blocks=-(-longest // 16) * 2 + 64, host_kv_dir=str(work / "decode-host"), max_num_batched_tokens=2048,
    )
    engine = build_engine(model, config)
    kv = engine.core.runner.kv
    device_bytes = kv.pool.kv.nbytes() + kv.staging_nbytes()
    rows = []
    for ctx in sorted(args.contexts):
        prompt = random_prompts(1, ctx, VOCAB, seed=ctx)[0]
        engine.add_request(prompt_token_ids=prompt, params=SamplingParams(
            max_tokens=args.decode_steps + 1, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        while not engine.num_running:  # prefill
            engine.step()
        prefill_s = time.perf_counter() - t0
        steps = []
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        step = statistics.median(steps)
        row = {"context": ctx, "prefill_s": prefill_s, "decode_step_ms": step * 1e3, "ms_per_1k_tokens": step * 1e6 / ctx,
               "device_bytes": device_bytes, "peak_device_blocks": kv.pool.peak_in_use}
        rows.append(row)
        print(f"{ctx:>8} {prefill_s:10.1f} {row['decode_step_ms']:12.2f} {row['ms_per_1k_tokens']:14.3f} "
              f"{device_bytes / 2**20:12.2f} {kv.pool.peak_in_use:>10}", flush=True)
    return rows


def _max_bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = bench_model_dir("tiny")
    ctx, best, last_s = args.max_start, None, 0.0
    while True:
        config = EngineConfig(
            max_model_len=ctx + 64, num_kv_blocks=args.max_device_blocks, prefill_chunk_tokens=args.max_chunk,
            max_num_batched_tokens=args.max_chunk, host_kv_blocks=-(-ctx // 16) + 64, host_kv_dir=str(work / f"max-{ctx}"),
        )
        engine = build_engine(model, config)
        prompt = random_prompts(1, ctx, VOCAB, seed=ctx + 1)[0]
        t0 = time.perf_counter()
        first = None
        engine.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        for _ in engine.run():
            first = first or time.perf_counter() - t0
        total = time.perf_counter() - t0
        print(f"{ctx:>10} tokens: time to first token {first:8.1f} s, end to end {total:8.1f} s", flush=True)
        if total > args.budget_s:
            break
        best, last_s = {"context": ctx, "ttft_s": first, "total_s": total}, total
        # attention is quadratic: doubling costs up to 4x; stop before a run that cannot finish in time
        if last_s * 4 > args.budget_s:
            break
        ctx *= 2
        del engine
    return {"largest": best, "budget_s": args.budget_s}


def run(args: argparse.Namespace) -> int:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="strata-bench-kv-") as tmp:
        work = args.workdir or Path(tmp)
        if "ttft" in args.parts:
            print(f"# TTFT, {args.prompt_len}-token prompt sharing {args.shared:.0%} with an earlier one, model "
                  f"{args.model}, fp32 CPU; cached rows: median of {args.repeats} prompts with fresh suffixes")
            results["ttft"] = _ttft_bench(args, work)
        if "decode" in args.parts:
            print(f"\n# decode step vs context, tiny model, device tier fixed at {args.device_blocks} blocks "
                  f"(+ staging), older blocks streamed from the host tier")
            print(f"{'context':>8} {'prefill s':>10} {'step ms':>12} {'ms/1K tokens':>14} {'device MiB':>12} {'peak blk':>10}")
            results["decode"] = _decode_bench(args, work)
        if "max" in args.parts:
            print(f"\n# largest context end to end (prefill + 4 tokens) within {args.budget_s:.0f} s, tiny model, "
                  f"device tier {args.max_device_blocks} blocks + host tier, chunks of {args.max_chunk}")
            results["max"] = _max_bench(args, work)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    sys.stdout.flush()
    return 0

"""`strata bench offline`: the engine against transformers `generate` on the same checkpoint.

Compared side by side in one run (this machine is shared and noisy, so only the ratios
mean something):
  1. output tokens/s, engine vs transformers, greedy, ignore EOS, fixed prompt/output lengths,
     at batch 1 and batch N, for a tiny and a small model;
  2. prefill time of N requests sharing a long prefix: prefix caching off (cold) vs on with
     the prefix already cached.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from strata.pipeline.config import EngineConfig
from strata.pipeline.sampling_params import SamplingParams
from strata.stages.factory import build_engine
from strata.pipeline.tiny_model import TinyModelSpec, build_tiny_model, default_cache_dir

SIZES = {
    "tiny": TinyModelSpec(),
    "small": TinyModelSpec(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", choices=sorted(SIZES), default=["tiny", "small"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--prefix-model", choices=sorted(SIZES), default="small")
    p.add_argument("--skip-prefix", action="store_true")
    p.add_argument("--json", type=Path, help="also write the results here")


def bench_model_dir(size: str) -> Path:
    path = default_cache_dir() / "bench" / f"{size}-llava-llama"
    if not (path / "config.json").is_file():
        build_tiny_model(SIZES[size], path)
    return path


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids >= 8 avoid the special tokens (<image> among them)
    return torch.randint(8, vocab, (n, length), generator=g).tolist()


def _hf_tokens_per_s(model_dir: Path, prompts: list[list[int]], output_len: int) -> float:
    from transformers import LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(str(model_dir)).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=3)
    with torch.inference_mode():
        hf.generate(input_ids=ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=3)  # warm-up
        t0 = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        dt = time.perf_counter() - t0
    return (out.shape[0] * (out.shape[1] - ids.shape[1])) / dt


def _engine_tokens_per_s(engine: Any, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate([{"prompt_token_ids": prompts[0][:8], "params": SamplingParams(max_tokens=2, temperature=0)}])
    t0 = time.perf_counter()
    outs = engine.generate([{"prompt_token_ids": p, "params": params} for p in prompts])
    dt = time.perf_counter() - t0
    return sum(len(o.output_token_ids) for o in outs) / dt


def _prefill_seconds(engine: Any, prompts: list[list[int]]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.generate([{"prompt_token_ids": p, "params": params} for p in prompts])
    return time.perf_counter() - t0


def _prefix_bench(args: argparse.Namespace) -> dict[str, float]:
    model_dir = bench_model_dir(args.prefix_model)
    vocab = 512
    prefix = random_prompts(1, args.prefix_len, vocab, seed=1)[0]
    suffixes = random_prompts(args.prefix_requests, 16, vocab, seed=2)
    prompts = [prefix + s for s in suffixes]
    blocks = args.prefix_requests * (-(-(args.prefix_len + 32) // 16)) + 64
    base = dict(num_kv_blocks=blocks, max_model_len=args.prefix_len + 64, max_num_seqs=args.prefix_requests)
    cold = build_engine(model_dir, EngineConfig(enable_prefix_caching=False, **base))
    t_cold = _prefill_seconds(cold, prompts)
    del cold
    warm = build_engine(model_dir, EngineConfig(enable_prefix_caching=True, **base))
    _prefill_seconds(warm, [prefix + [9] * 16])  # puts the shared prefix in the cache
    t_cached = _prefill_seconds(warm, prompts)
    return {"cold_s": t_cold, "cached_s": t_cached, "speedup": t_cold / t_cached}


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    results: dict[str, Any] = {"throughput": [], "prefix": None}
    print(f"# engine vs transformers generate: greedy, {args.prompt_len} prompt / {args.output_len} output tokens, "
          f"ignore EOS, fp32 CPU, torch threads={torch.get_num_threads()}")
    print(f"{'model':<7} {'batch':>5} {'hf tok/s':>10} {'engine tok/s':>13} {'ratio':>7}")
    for size in args.models:
        model_dir = bench_model_dir(size)
        engine = build_engine(model_dir, EngineConfig(max_model_len=args.prompt_len + args.output_len + 16))
        for batch in args.batches:
            prompts = random_prompts(batch, args.prompt_len, 512, seed=batch)
            hf = _hf_tokens_per_s(model_dir, prompts, args.output_len)
            ours = _engine_tokens_per_s(engine, prompts, args.output_len)
            row = {"model": size, "batch": batch, "hf_tok_s": hf, "engine_tok_s": ours, "ratio": ours / hf}
            results["throughput"].append(row)
            print(f"{size:<7} {batch:>5} {hf:>10.1f} {ours:>13.1f} {ours / hf:>6.2f}x", flush=True)
    if not args.skip_prefix:
        print(f"\n# prefill of {args.prefix_requests} requests sharing a {args.prefix_len}-token prefix "
              f"(+16 own tokens), model {args.prefix_model}: prefix cache off vs prefix already cached")
        res = _prefix_bench(args)
        results["prefix"] = res
        print(f"cold {res['cold_s']:.2f} s   cached {res['cached_s']:.3f} s   speedup {res['speedup']:.1f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    sys.stdout.flush()
    return 0

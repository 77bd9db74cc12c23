"""`strata bench offline`: the engine against transformers on the same checkpoint, side by side in one run.

This machine is shared and noisy, so every comparison interleaves the two sides (A B A B ...) for
``--repeats`` rounds on the same prompts and reports medians and their ratio. Sections:

  throughput  output tokens/s of greedy generation (ignore EOS, fixed lengths) vs transformers
              ``generate``, per model, dtype and batch size;
  prefill     tokens/s of one long prompt (``--prefill-len``) vs one transformers forward;
  bandwidth   a batch-1 decode step of the small model: bytes it must move (weights + KV read)
              divided by its time, as a fraction of this machine's copy bandwidth (measured here);
  compile     ``EngineConfig.compile``: compile time, first-request latency, steady state vs eager;
  prefix      prefill of requests sharing a long prefix: prefix cache off vs the prefix cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.stages.factory import build_engine
from strata.checkpoints.tiny_model import TinyModelSpec, build_tiny_model, default_cache_dir

SIZES = {
    "tiny": TinyModelSpec(),
    "small": TinyModelSpec(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408),
}
SECTIONS = ("throughput", "prefill", "bandwidth", "compile", "prefix")
VOCAB = 512


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--models", nargs="+", choices=sorted(SIZES), default=["tiny", "small"])
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds per comparison (medians reported)")
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--prefill-model", choices=sorted(SIZES), default="small")
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--prefix-model", choices=sorted(SIZES), default="small")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--backend", default="auto", help="attention backend of the engine")
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


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _interleaved(sides: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median of each side's measurement over ``repeats`` rounds, the sides alternating within a round."""
    runs: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            runs[name].append(fn())
    return {name: statistics.median(values) for name, values in runs.items()}


def _hf_model(model_dir: Path, dtype: str, device: str) -> Any:
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()


def _engine(model_dir: Path, args: argparse.Namespace, dtype: str, **overrides: Any) -> Any:
    config = dict(max_model_len=args.prompt_len + args.output_len + 16, dtype=dtype, device=args.device,
                  attention_backend=args.backend)
    return build_engine(model_dir, EngineConfig(**{**config, **overrides}))


def _hf_tok_s(hf: Any, prompts: list[list[int]], output_len: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=3)
    with torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        _sync(device)
        dt = time.perf_counter() - t0
    return out.shape[0] * (out.shape[1] - ids.shape[1]) / dt


def _engine_tok_s(engine: Any, prompts: list[list[int]], output_len: int, device: str) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.generate([{"prompt_token_ids": p, "params": params} for p in prompts])
    _sync(device)
    return sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - t0)


def _throughput(args: argparse.Namespace) -> list[dict[str, Any]]:
    print(f"\n# throughput: greedy, {args.prompt_len} prompt / {args.output_len} output tokens, ignore EOS; "
          f"medians of {args.repeats} interleaved rounds (fresh prompts each round; the prefix cache cannot help)")
    print(f"{'model':<6} {'dtype':<9} {'batch':>5} {'hf tok/s':>10} {'engine tok/s':>13} {'ratio':>7}")
    rows = []
    for size in args.models:
        model_dir = bench_model_dir(size)
        for dtype in args.dtypes:
            hf, engine = _hf_model(model_dir, dtype, args.device), _engine(model_dir, args, dtype)
            warm = random_prompts(2, 16, VOCAB, seed=0)
            _hf_tok_s(hf, warm, 2, args.device), _engine_tok_s(engine, warm, 2, args.device)
            for batch in args.batches:
                # each round has fresh prompts, the same for both sides
                seeds = [random_prompts(batch, args.prompt_len, VOCAB, seed=1000 * batch + r) for r in range(args.repeats)]
                it_hf, it_en = iter(seeds), iter(seeds)
                res = _interleaved({
                    "hf": lambda: _hf_tok_s(hf, next(it_hf), args.output_len, args.device),
                    "engine": lambda: _engine_tok_s(engine, next(it_en), args.output_len, args.device),
                }, args.repeats)
                row = {"model": size, "dtype": dtype, "batch": batch, "hf_tok_s": res["hf"],
                       "engine_tok_s": res["engine"], "ratio": res["engine"] / res["hf"]}
                rows.append(row)
                print(f"{size:<6} {dtype:<9} {batch:>5} {res['hf']:>10.1f} {res['engine']:>13.1f} "
                      f"{row['ratio']:>6.2f}x", flush=True)
    return rows


def _prefill(args: argparse.Namespace) -> dict[str, Any]:
    n = args.prefill_len
    model_dir = bench_model_dir(args.prefill_model)
    print(f"\n# prefill: one {n}-token prompt, model {args.prefill_model} fp32; transformers forward (last-position "
          f"logits) vs the engine (prefix cache off), one chunk and {min(512, n)}-token chunks; "
          f"medians of {args.repeats} interleaved rounds")
    hf = _hf_model(model_dir, "float32", args.device)
    one = _engine(model_dir, args, "float32", max_model_len=n + 16, enable_prefix_caching=False,
                  prefill_chunk_tokens=n, max_num_batched_tokens=n)
    chunked = _engine(model_dir, args, "float32", max_model_len=n + 16, enable_prefix_caching=False)
    prompt = random_prompts(1, n, VOCAB, seed=7)[0]
    ids = torch.tensor([prompt], device=args.device)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def hf_s() -> float:
        with torch.inference_mode():
            _sync(args.device)
            t0 = time.perf_counter()
            hf(input_ids=ids, logits_to_keep=1)
            _sync(args.device)
            return time.perf_counter() - t0

    def engine_s(engine: Any) -> Callable[[], float]:
        def run() -> float:
            _sync(args.device)
            t0 = time.perf_counter()
            engine.generate([{"prompt_token_ids": prompt, "params": params}])
            _sync(args.device)
            return time.perf_counter() - t0
        return run

    res = _interleaved({"hf": hf_s, "one_chunk": engine_s(one), "chunked": engine_s(chunked)}, args.repeats)
    out = {"tokens": n, **{f"{k}_tok_s": n / v for k, v in res.items()}}
    out["ratio_one_chunk"] = res["hf"] / res["one_chunk"]
    out["ratio_chunked"] = res["hf"] / res["chunked"]
    print(f"transformers {out['hf_tok_s']:.0f} tok/s   engine one chunk {out['one_chunk_tok_s']:.0f} tok/s "
          f"({out['ratio_one_chunk']:.2f}x)   engine 512-token chunks {out['chunked_tok_s']:.0f} tok/s "
          f"({out['ratio_chunked']:.2f}x)")
    return out


def copy_bandwidth(device: str, nbytes: int = 256 << 20) -> float:
    """Bytes read + written per second by a large tensor copy on this machine (the yardstick)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    times = []
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times)


def _bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = bench_model_dir("small")
    engine = _engine(model_dir, args, "float32")
    runner = engine.core.runner
    model = runner.model
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if not n.startswith("embed_tokens")) + model.cfg.hidden_size * 4  # one embedding row
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(prompt_token_ids=random_prompts(1, args.prompt_len, VOCAB, seed=3)[0], params=params)
    seq = engine._requests[rid]
    times, contexts = [], []
    while engine.has_unfinished():
        prefilling = seq.num_computed_tokens < seq.num_prompt_tokens
        _sync(args.device)
        t0 = time.perf_counter()
        engine.step()
        _sync(args.device)
        if not prefilling:
            times.append(time.perf_counter() - t0)
            contexts.append(seq.num_tokens)
    lay = engine.kv.layout
    kv_bytes = statistics.median(contexts) * lay.bytes_per_token()
    step = statistics.median(times)
    bw = copy_bandwidth(args.device)
    out = {"step_s": step, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
           "achieved_bytes_per_s": (weight_bytes + kv_bytes) / step, "copy_bytes_per_s": bw}
    out["fraction_of_copy_bandwidth"] = out["achieved_bytes_per_s"] / bw
    print(f"\n# bandwidth: small model fp32, batch-1 decode step (median of {len(times)} steps, context ~"
          f"{statistics.median(contexts):.0f}); bytes that must move = weights {weight_bytes / 2**20:.1f} MiB + KV "
          f"{kv_bytes / 2**20:.2f} MiB")
    print(f"step {step * 1e3:.2f} ms -> {out['achieved_bytes_per_s'] / 1e9:.1f} GB/s; copy bandwidth here "
          f"{bw / 1e9:.1f} GB/s (read+write); {out['fraction_of_copy_bandwidth']:.0%} of it")
    return out


def _compile(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = bench_model_dir("tiny")
    print("\n# compile: tiny model fp32, EngineConfig.compile (torch.compile of the dense step parts) vs eager")
    out: dict[str, Any] = {}
    engines = {}
    for mode in ("eager", "compiled"):
        t0 = time.perf_counter()
        engine = _engine(model_dir, args, "float32", compile=mode == "compiled")
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.generate([{"prompt_token_ids": random_prompts(1, 32, VOCAB, seed=11)[0],
                          "params": SamplingParams(max_tokens=1, temperature=0.0)}])
        out[mode] = {"build_s": build_s, "first_request_s": time.perf_counter() - t0,
                     "compile_s": engine.core.runner.compile_seconds}
        engines[mode] = engine
    seeds = [random_prompts(32, args.prompt_len, VOCAB, seed=500 + r) for r in range(args.repeats)]
    its = {m: iter(seeds) for m in engines}
    res = _interleaved({m: (lambda m=m: _engine_tok_s(engines[m], next(its[m]), args.output_len, args.device))
                        for m in engines}, args.repeats)
    for mode in engines:
        out[mode]["steady_tok_s"] = res[mode]
    out["steady_ratio"] = res["compiled"] / res["eager"]
    for mode in engines:
        o = out[mode]
        print(f"{mode:<9} build {o['build_s']:.1f} s (compile {o['compile_s']:.1f} s)   first request "
              f"{o['first_request_s'] * 1e3:.0f} ms   steady batch 32: {o['steady_tok_s']:.0f} tok/s")
    print(f"compiled / eager steady state: {out['steady_ratio']:.2f}x")
    return out


def _prefix(args: argparse.Namespace) -> dict[str, float]:
    model_dir = bench_model_dir(args.prefix_model)
    prefix = random_prompts(1, args.prefix_len, VOCAB, seed=1)[0]
    prompts = [prefix + s for s in random_prompts(args.prefix_requests, 16, VOCAB, seed=2)]
    blocks = args.prefix_requests * (-(-(args.prefix_len + 32) // 16)) + 64
    base = dict(num_kv_blocks=blocks, max_model_len=args.prefix_len + 64, max_num_seqs=args.prefix_requests)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def seconds(engine: Any, batch: list[list[int]]) -> float:
        t0 = time.perf_counter()
        engine.generate([{"prompt_token_ids": p, "params": params} for p in batch])
        return time.perf_counter() - t0

    print(f"\n# prefix: prefill of {args.prefix_requests} requests sharing a {args.prefix_len}-token prefix "
          f"(+16 own tokens), model {args.prefix_model}: prefix cache off vs prefix already cached")
    t_cold = seconds(_engine(model_dir, args, "float32", enable_prefix_caching=False, **base), prompts)
    warm = _engine(model_dir, args, "float32", enable_prefix_caching=True, **base)
    seconds(warm, [prefix + [9] * 16])  # puts the shared prefix in the cache
    t_cached = seconds(warm, prompts)
    res = {"cold_s": t_cold, "cached_s": t_cached, "speedup": t_cold / t_cached}
    print(f"cold {res['cold_s']:.2f} s   cached {res['cached_s']:.3f} s   speedup {res['speedup']:.1f}x")
    return res


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    print(f"# strata bench offline: device {args.device}, attention backend {args.backend}, "
          f"torch threads {torch.get_num_threads()}, same checkpoints for both sides")
    parts = {"throughput": _throughput, "prefill": _prefill, "bandwidth": _bandwidth, "compile": _compile,
             "prefix": _prefix}
    results = {name: parts[name](args) for name in SECTIONS if name in args.sections}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    sys.stdout.flush()
    return 0

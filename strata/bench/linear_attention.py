"""`strata bench linear`: what linear attention buys a hybrid, measured side by side.

Four figures, each printed with what it compared:

* **decode TPOT against context** on a tiny Qwen3-Next built here (one full-attention layer in four, fp32),
  prefilled to each ``--contexts`` length, then 16 tokens decoded: the linear layers cost the same at every
  length, so the hybrid's TPOT grows only by its one attention layer's share; and that layer's decode at the
  longest context in the C++ kernel on one thread against split over every thread;
* **one decode step of one layer** at Qwen3-Next-80B's shapes: a Gated DeltaNet step (32 value heads of a
  128 x 128 state; the torch reference and the C++ kernel), and KDA's (Kimi-Linear-48B: the same state, a
  decay per key channel), against full attention (16 query heads over 2 KV heads of 256) at each context;
* **chunked prefill**: ``kernels.delta_rule.delta_rule_chunked`` against transformers' torch references
  (``torch_chunk_gated_delta_rule``; ``chunk_kimi_delta_attention`` on an eighth of the rows, as its
  reference holds every block's [64, 64, 128] decay at once) on the same rows, tok/s (outputs checked equal);
* **memory per sequence** at 128K and 1M from the planner: Qwen3-Next-80B and Kimi-Linear-48B, each
  against the same model with every layer full attention.
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
import torch.nn.functional as F

from strata.bench.quant_linear import median_ms
from strata.kernels.cpu_kernels import cpu_kernels
from strata.kernels.delta_rule import (delta_rule_chunked, delta_rule_step, delta_rule_step_slots, l2_normalize,
                                       l2_normalize_div)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", nargs="+", type=int, default=[4096, 32768])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefill-rows", type=int, default=4096)
    p.add_argument("--kv-cache-dtypes", nargs="+", choices=["auto", "fp8"], default=["auto"],
                   help="decode TPOT with each KV cache dtype (fp8: a quarter of fp32's bytes a key), side by side")
    p.add_argument("--json", type=Path)


def _tpot_ms(engine: Any, context: int) -> float:
    """Median time between the 16 decoded tokens after a ``context``-token prompt."""
    from strata.pipeline.contract.sampling_params import SamplingParams

    ids = torch.randint(4, 500, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    engine.add_request(prompt_token_ids=ids, params=SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True))
    stamps = [time.perf_counter() for _ in engine.run()]
    return 1000 * statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:]))


def _layer_steps(contexts: list[int], rounds: int) -> dict[str, float]:
    """One decode step of one layer at Qwen3-Next-80B's shapes, fp32 on this machine."""
    gen = torch.Generator().manual_seed(0)
    hv, dk, dv = 32, 128, 128
    q, k = l2_normalize(torch.randn(1, hv, dk, generator=gen)), l2_normalize(torch.randn(1, hv, dk, generator=gen))
    v, g, beta = torch.randn(1, hv, dv, generator=gen), -torch.rand(1, hv, generator=gen), torch.rand(1, hv, generator=gen)
    state = torch.zeros(1, hv, dk, dv)
    per_channel = -torch.rand(1, hv, dk, generator=gen)  # KDA's decay
    out = {"gated_deltanet": median_ms(lambda: delta_rule_step(q, k, v, g, beta, state), rounds),
           "kda": median_ms(lambda: delta_rule_step(q, k, v, per_channel, beta, state), rounds)}
    pool, read, write = torch.zeros(2, hv, dk, dv), torch.tensor([0]), torch.tensor([1])
    if cpu_kernels() is not None:  # the C++ step, reading and writing pool slots in place
        out["gated_deltanet_cpp"] = median_ms(lambda: delta_rule_step_slots(q, k, v, g, beta, pool, read, write), rounds)
        out["kda_cpp"] = median_ms(lambda: delta_rule_step_slots(q, k, v, per_channel, beta, pool, read, write), rounds)
    for n in contexts:
        query = torch.randn(1, 16, 1, 256, generator=gen)
        keys, values = torch.randn(1, 2, n, 256, generator=gen), torch.randn(1, 2, n, 256, generator=gen)
        out[f"attention_{n}"] = median_ms(lambda: F.scaled_dot_product_attention(query, keys, values,
                                                                                  enable_gqa=True), rounds)
    return out


def _split_decode(cfg: Any, n: int, rounds: int) -> dict[str, float]:
    """One decode over ``n`` keys of the tiny model's full-attention layer in the C++ paged kernel, on one
    thread (one work item on one core: a lone decode before the kernel split it) and on every thread (split by
    keys, merged by log-sum-exp); interleaved rounds, medians."""
    from strata.kernels import AttentionMetadata, get_attention_backend

    gen, bs = torch.Generator().manual_seed(n), 16
    blocks = -(-n // bs)
    k = torch.randn(blocks, bs, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    v = torch.randn(blocks, bs, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    q = torch.randn(1, cfg.num_heads, cfg.head_dim, generator=gen)
    meta = AttentionMetadata.build([1], [n], [list(range(blocks))], [n - 1], bs)
    backend, threads = get_attention_backend("cpu", "cpu"), torch.get_num_threads()
    times: dict[int, list[float]] = {1: [], threads: []}
    try:
        for _ in range(rounds):
            for t in times:
                torch.set_num_threads(t)
                times[t].append(median_ms(lambda: backend.forward(q, k, v, meta, cfg.head_dim**-0.5, None), 3))
    finally:
        torch.set_num_threads(threads)
    return {"one_thread_ms": statistics.median(times[1]), "split_ms": statistics.median(times[threads]),
            "threads": threads}


def _prefill(rows: int, rounds: int, per_channel: bool = False) -> dict[str, float]:
    """tok/s of the chunked delta rule, ours against transformers' reference, 32 heads of 128 x 128; with
    ``per_channel``, KDA's form against Kimi-Linear's reference."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(rows, 32, 128, generator=gen), torch.randn(rows, 32, 128, generator=gen)
    v, beta = torch.randn(rows, 32, 128, generator=gen), torch.rand(rows, 32, generator=gen)
    g = -torch.rand(*((rows, 32, 128) if per_channel else (rows, 32)), generator=gen)
    state = torch.zeros(32, 128, 128)
    norm = l2_normalize_div if per_channel else l2_normalize
    qn, kn = norm(q) * 128**-0.5, norm(k)
    reference = chunk_kimi_delta_attention if per_channel else torch_chunk_gated_delta_rule
    ours = lambda: delta_rule_chunked(qn, kn, v, g, beta, state)  # noqa: E731
    ref = lambda: reference(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],  # noqa: E731
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours()[0], ref()[0][0], rtol=1e-4, atol=1e-4)
    return {"strata_tok_s": rows / (median_ms(ours, rounds) / 1000),
            "transformers_tok_s": rows / (median_ms(ref, rounds) / 1000)}


def _memory() -> dict[str, dict[str, int]]:
    from strata.planning.memory_plan import plan_memory
    from strata.planning.model_shapes import BUILTIN_SHAPES

    kimi = BUILTIN_SHAPES["kimi-linear-48b"]
    every_layer_full = {
        "qwen3-next-80b": {**BUILTIN_SHAPES["qwen3-next-80b"], "layer_types": ["full_attention"] * 48},
        "kimi-linear-48b": {**kimi, "linear_attn_config": {**kimi["linear_attn_config"], "kda_layers": [],
                                                           "full_attn_layers": list(range(1, 28))}}}
    out: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model, shape in every_layer_full.items():
            full = Path(tmp) / model / "config.json"
            full.parent.mkdir()
            full.write_text(json.dumps(shape))
            for name, source in ((f"{model} hybrid", model), (f"{model} all full attention", str(full.parent))):
                out[name] = {f"{n // 1000}K": plan_memory(source, n, 1, 2**40).kv_bytes_needed
                             for n in (128_000, 1_000_000)}
    return out


def run(args: argparse.Namespace) -> int:
    from strata.checkpoints.tiny_text_models import build_tiny_text_model
    from strata.pipeline.contract.config import EngineConfig
    from strata.pipeline.models.model_config import load_model_config
    from strata.stages.factory import build_engine

    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="strata-linear-") as tmp:
        model = build_tiny_text_model("qwen3_next", Path(tmp) / "q3n")
        longest = max(args.contexts) + 64
        print(f"# linear: tiny Qwen3-Next (1 of 4 layers full attention), fp32, {torch.get_num_threads()} threads; "
              "decode TPOT after a prompt of each length (median of 16 tokens)")
        for kv_dtype in args.kv_cache_dtypes:
            engine = build_engine(model, EngineConfig(max_model_len=longest, num_kv_blocks=longest // 16 + 64,
                                                      enable_prefix_caching=False, kv_cache_dtype=kv_dtype))
            key = "tpot_ms" if kv_dtype == "auto" else f"tpot_ms_{kv_dtype}_kv"
            rows[key] = {n: _tpot_ms(engine, n) for n in sorted(args.contexts)}
            engine.close()
            base = rows[key][min(args.contexts)]
            for n, ms in rows[key].items():
                print(f"  {'fp32' if kv_dtype == 'auto' else kv_dtype} KV, context {n:>7,}: TPOT {ms:7.2f} ms  "
                      f"({ms / base:.2f}x the shortest)")
        if cpu_kernels() is not None:
            longest_context = max(args.contexts)
            rows["split_decode"] = split = _split_decode(load_model_config(model).text, longest_context, args.rounds)
            print(f"# its full-attention layer, one decode over {longest_context:,} keys in the C++ paged kernel: "
                  f"{split['one_thread_ms']:.3f} ms on one thread (one work item) vs {split['split_ms']:.3f} ms "
                  f"split over {split['threads']} threads ({split['one_thread_ms'] / split['split_ms']:.2f}x)")
    rows["layer_step_ms"] = steps = _layer_steps(sorted(args.contexts), args.rounds)
    print("# one decode step of one layer at Qwen3-Next-80B's shapes (fp32, median of "
          f"{args.rounds}): Gated DeltaNet {steps['gated_deltanet']:.3f} ms at any context (torch; C++ "
          f"{steps.get('gated_deltanet_cpp', float('nan')):.3f} ms), KDA {steps['kda']:.3f} ms (C++ "
          f"{steps.get('kda_cpp', float('nan')):.3f} ms); full attention " +
          ", ".join(f"{steps[f'attention_{n}']:.3f} ms at {n:,}" for n in sorted(args.contexts)))
    kda_rows = max(64, args.prefill_rows // 8)
    rows["prefill"] = {"gated_deltanet": _prefill(args.prefill_rows, args.rounds),
                       "kda": _prefill(kda_rows, args.rounds, per_channel=True)}
    for name, n in (("gated_deltanet", args.prefill_rows), ("kda", kda_rows)):
        pre = rows["prefill"][name]
        print(f"# chunked delta rule ({name}), {n:,} rows x 32 heads of 128 x 128: Strata "
              f"{pre['strata_tok_s']:,.0f} tok/s, transformers' torch reference {pre['transformers_tok_s']:,.0f} tok/s "
              f"({pre['strata_tok_s'] / pre['transformers_tok_s']:.2f}x; outputs equal)")
    rows["memory_bytes"] = mem = _memory()
    print("# KV + state for one sequence (strata plan, bf16): " + "; ".join(
        f"{name} {', '.join(f'{v / 2**30:.2f} GiB at {k}' for k, v in by.items())}" for name, by in mem.items()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0

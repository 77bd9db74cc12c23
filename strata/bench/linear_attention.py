"""`strata bench linear`: what linear attention buys a hybrid, measured side by side.

Four figures, each printed with what it compared:

* **decode TPOT against context** on a tiny Qwen3-Next built here (one full-attention layer in four, fp32),
  prefilled to each ``--contexts`` length, then 16 tokens decoded: the linear layers cost the same at every
  length, so the hybrid's TPOT grows only by its one attention layer's share;
* **one decode step of one layer** at Qwen3-Next-80B's shapes: a Gated DeltaNet step (32 value heads of a
  128 x 128 state; the torch reference and the C++ kernel) against full attention (16 query heads over 2 KV
  heads of 256) at each context length;
* **chunked prefill**: ``kernels.delta_rule.delta_rule_chunked`` against transformers' torch reference
  (``torch_chunk_gated_delta_rule``) on the same rows, tok/s (the outputs are checked equal first);
* **memory per sequence** at 128K and 1M from the planner: Qwen3-Next-80B against the same model with
  every layer full attention.
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
from strata.kernels.delta_rule import delta_rule_chunked, delta_rule_step, delta_rule_step_slots, l2_normalize


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", nargs="+", type=int, default=[4096, 32768])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefill-rows", type=int, default=4096)
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
    out = {"gated_deltanet": median_ms(lambda: delta_rule_step(q, k, v, g, beta, state), rounds)}
    pool, read, write = torch.zeros(2, hv, dk, dv), torch.tensor([0]), torch.tensor([1])
    if cpu_kernels() is not None:  # the C++ step, reading and writing pool slots in place
        out["gated_deltanet_cpp"] = median_ms(lambda: delta_rule_step_slots(q, k, v, g, beta, pool, read, write), rounds)
    for n in contexts:
        query = torch.randn(1, 16, 1, 256, generator=gen)
        keys, values = torch.randn(1, 2, n, 256, generator=gen), torch.randn(1, 2, n, 256, generator=gen)
        out[f"attention_{n}"] = median_ms(lambda: F.scaled_dot_product_attention(query, keys, values,
                                                                                  enable_gqa=True), rounds)
    return out


def _prefill(rows: int, rounds: int) -> dict[str, float]:
    """tok/s of the chunked delta rule, ours against transformers' reference, 32 heads of 128 x 128."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(rows, 32, 128, generator=gen), torch.randn(rows, 32, 128, generator=gen)
    v, g, beta = torch.randn(rows, 32, 128, generator=gen), -torch.rand(rows, 32, generator=gen), torch.rand(rows, 32, generator=gen)
    state = torch.zeros(32, 128, 128)
    qn, kn = l2_normalize(q) * 128**-0.5, l2_normalize(k)
    ours = lambda: delta_rule_chunked(qn, kn, v, g, beta, state)  # noqa: E731
    ref = lambda: torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],  # noqa: E731
                                               output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours()[0], ref()[0][0], rtol=1e-4, atol=1e-4)
    return {"strata_tok_s": rows / (median_ms(ours, rounds) / 1000),
            "transformers_tok_s": rows / (median_ms(ref, rounds) / 1000)}


def _memory() -> dict[str, dict[str, int]]:
    from strata.planning.memory_plan import plan_memory
    from strata.planning.model_shapes import BUILTIN_SHAPES

    out: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "config.json"
        full.write_text(json.dumps({**BUILTIN_SHAPES["qwen3-next-80b"], "layer_types": ["full_attention"] * 48}))
        for name, model in (("hybrid", "qwen3-next-80b"), ("full attention", str(full))):
            out[name] = {f"{n // 1000}K": plan_memory(model, n, 1, 2**40).kv_bytes_needed for n in (128_000, 1_000_000)}
    return out


def run(args: argparse.Namespace) -> int:
    from strata.checkpoints.tiny_text_models import build_tiny_text_model
    from strata.pipeline.contract.config import EngineConfig
    from strata.stages.factory import build_engine

    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="strata-linear-") as tmp:
        model = build_tiny_text_model("qwen3_next", Path(tmp) / "q3n")
        longest = max(args.contexts) + 64
        engine = build_engine(model, EngineConfig(max_model_len=longest, num_kv_blocks=longest // 16 + 64,
                                                  enable_prefix_caching=False))
        print(f"# linear: tiny Qwen3-Next (1 of 4 layers full attention), fp32, {torch.get_num_threads()} threads; "
              "decode TPOT after a prompt of each length (median of 16 tokens)")
        rows["tpot_ms"] = {n: _tpot_ms(engine, n) for n in sorted(args.contexts)}
        base = rows["tpot_ms"][min(args.contexts)]
        for n, ms in rows["tpot_ms"].items():
            print(f"  context {n:>7,}: TPOT {ms:7.2f} ms  ({ms / base:.2f}x the shortest)")
    rows["layer_step_ms"] = steps = _layer_steps(sorted(args.contexts), args.rounds)
    print("# one decode step of one layer at Qwen3-Next-80B's shapes (fp32, median of "
          f"{args.rounds}): Gated DeltaNet {steps['gated_deltanet']:.3f} ms at any context (torch; C++ "
          f"{steps.get('gated_deltanet_cpp', float('nan')):.3f} ms); full attention " +
          ", ".join(f"{steps[f'attention_{n}']:.3f} ms at {n:,}" for n in sorted(args.contexts)))
    rows["prefill"] = pre = _prefill(args.prefill_rows, args.rounds)
    print(f"# chunked delta rule, {args.prefill_rows:,} rows x 32 heads of 128 x 128: Strata "
          f"{pre['strata_tok_s']:,.0f} tok/s, transformers' torch reference {pre['transformers_tok_s']:,.0f} tok/s "
          f"({pre['strata_tok_s'] / pre['transformers_tok_s']:.2f}x; outputs equal)")
    rows["memory_bytes"] = mem = _memory()
    print("# KV + state for one sequence (strata plan, bf16): " + "; ".join(
        f"{name} {', '.join(f'{v / 2**30:.2f} GiB at {k}' for k, v in by.items())}" for name, by in mem.items()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0

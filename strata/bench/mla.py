"""`strata bench mla`: one MLA decode step, weight-absorbed form against the expanded form, side by side.

One attention layer of the shape given (Kimi-K2's by default: 64 heads, a 512 + 64 latent, q/k no-RoPE
dims 128, v 128), one new token attending to ``--contexts`` cached tokens. Compared, in interleaved
rounds (medians):

* absorbed, as Strata serves it: ``q_nope`` folded through ``W_UK`` into latent space, Strata's CPU
  backend over the paged latent cache (one tensor as keys and values; the blocks are gathered, then
  every head attends in two GEMMs), ``W_UV`` on the output;
* absorbed, dense: the same math as two torch matmuls and a softmax (every head's scores against the
  one latent in one GEMM: the keys are shared);
* expanded: the cache holds every head's K (128 + 64) and V (128), as an MHA cache would; the same
  matmuls and softmax, batched over heads.

The two dense rows run the same torch ops, so their ratio is the form's, not the kernel's (torch's SDPA
with ``enable_gqa`` copies the shared latent to every head on CPU, so it is not used here). KV bytes
read per token per layer: absorbed ``(kv_lora_rank + rope) x dtype``; expanded ``heads x (qk + v) x
dtype``. All rows compute the same output (checked against each other before timing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from strata.kernels import AttentionMetadata, get_attention_backend


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", nargs="+", type=int, default=[4096, 32768])
    p.add_argument("--heads", type=int, default=64, help="query heads (Kimi-K2: 64, DeepSeek-V3: 128)")
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--nope-dim", type=int, default=128)
    p.add_argument("--v-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="KV cache dtype")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", type=Path)


def _median_ms(fns: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm up every path once
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved: machine noise hits every path alike
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_context(ctx: int, args: argparse.Namespace) -> dict:
    h, r, p, dn, dv, bs = args.heads, args.kv_lora_rank, args.rope_dim, args.nope_dim, args.v_dim, args.block_size
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(ctx)
    scale = (dn + p) ** -0.5
    latent = torch.randn(ctx, r + p, generator=gen).to(dtype)  # [c, k_pe] per token, as the cache holds it
    w_kv_b = (torch.randn(h, dn + dv, r, generator=gen) * r ** -0.5).to(dtype)
    w_uk, w_uv = w_kv_b[:, :dn], w_kv_b[:, dn:]
    q = torch.randn(h, dn + p, generator=gen).to(dtype)
    # expanded cache: what an MHA cache of this model would hold
    k_nope = torch.einsum("hdr,tr->htd", w_uk.float(), latent[:, :r].float())
    k_exp = torch.cat([k_nope, latent[:, r:].float().unsqueeze(0).expand(h, ctx, p)], dim=-1).to(dtype)[None]
    v_exp = torch.einsum("hdr,tr->htd", w_uv.float(), latent[:, :r].float()).to(dtype)[None]
    # paged latent cache for Strata's backend
    blocks = -(-ctx // bs)
    pool = torch.zeros(blocks, bs, 1, r + p, dtype=dtype)
    pool.view(-1, 1, r + p)[:ctx, 0] = latent
    meta = AttentionMetadata.build([1], [ctx], [list(range(blocks))], [ctx - 1], bs)
    backend = get_attention_backend("auto", "cpu")

    def absorb_q() -> torch.Tensor:
        q_lat = torch.bmm(q[:, None, :dn], w_uk)[:, 0]  # [H, r]
        return torch.cat([q_lat, q[:, dn:]], dim=-1)

    def absorbed_paged() -> torch.Tensor:
        out, _ = backend.forward(absorb_q()[None], pool, pool, meta, scale)
        return torch.bmm(out[0, :, None, :r], w_uv.transpose(1, 2))[:, 0]  # [H, dv]

    def absorbed_dense() -> torch.Tensor:
        probs = torch.softmax((absorb_q() @ latent.T).float() * scale, dim=-1).to(dtype)  # [H, ctx]: one GEMM
        return torch.bmm((probs @ latent[:, :r])[:, None], w_uv.transpose(1, 2))[:, 0]

    def expanded_dense() -> torch.Tensor:
        probs = torch.softmax(torch.bmm(q[:, None], k_exp[0].transpose(1, 2)).float() * scale, dim=-1).to(dtype)
        return torch.bmm(probs, v_exp[0])[:, 0]  # [H, dv]

    fns = {"absorbed (Strata CPU backend)": absorbed_paged, "absorbed (torch matmul)": absorbed_dense,
           "expanded (torch matmul)": expanded_dense}
    ref = expanded_dense().float()
    for name, fn in fns.items():
        err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
        if err > (1e-3 if dtype == torch.float32 else 5e-2):
            raise RuntimeError(f"{name} disagrees with the expanded form (max rel {err:.2e})")
    ms = _median_ms(fns, args.repeats)
    item = torch.tensor([], dtype=dtype).element_size()
    return {"context": ctx, "step_ms": ms,
            "kv_bytes_per_token": {"absorbed": (r + p) * item, "expanded": h * (dn + p + dv) * item}}


def run(args: argparse.Namespace) -> int:
    print(f"# strata bench mla: one decode step of one MLA layer ({args.heads} heads, latent {args.kv_lora_rank}+"
          f"{args.rope_dim}, qk {args.nope_dim}+{args.rope_dim}, v {args.v_dim}, {args.dtype} KV, "
          f"{torch.get_num_threads()} threads); medians of {args.repeats} interleaved rounds")
    rows = [bench_context(ctx, args) for ctx in args.contexts]
    print(f"{'context':>8}  {'form':<32} {'step ms':>9}  {'KV bytes/token/layer':>21}  {'vs expanded':>11}")
    for row in rows:
        expanded = row["step_ms"]["expanded (torch matmul)"]
        for form, ms in row["step_ms"].items():
            kind = "expanded" if form.startswith("expanded") else "absorbed"
            print(f"{row['context']:>8}  {form:<32} {ms:9.3f}  {row['kv_bytes_per_token'][kind]:>21,}  "
                  f"{expanded / ms:10.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("func", "json")},
                                         "rows": rows}, indent=2, default=str))
    return 0

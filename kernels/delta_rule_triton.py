"""The gated delta rule's decode step on CUDA: one Triton launch over every sequence and value head, each
state read from its pool slot and the new one written to another (as the C++ CPU kernel does), so no
gather or scatter of the states goes through memory twice.

A program owns one (sequence, head) and ``BLOCK_V`` columns of its [K, V] fp32 state: a column's update
needs only that column and the head's k, so the columns split across programs with no reduction between
them. Tested against the torch step on CPU under ``TRITON_INTERPRET=1`` (set before Triton is imported).
"""

from __future__ import annotations

import torch

from strata.kernels.triton_import import triton_kernel

BLOCK_V = 32


def _load():
    return triton_kernel("delta_rule_triton_kernel", "delta_rule_step_kernel")


def triton_delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           pool: torch.Tensor, read: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.delta_rule.delta_rule_step_slots` in one launch: q/k [B, H, K], v [B, H, V], beta [B, H],
    g [B, H] or [B, H, K] (KDA), pool [slots, H, K, V] fp32 (each slot's state contiguous), read/write [B] slots -> out [B, H, V]."""
    triton, kernel = _load()
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    b, h, dk = q.shape
    dv = v.shape[-1]
    if pool.stride(3) != 1 or pool.stride(2) != dv or pool.stride(1) != dk * dv:
        raise ValueError("each slot's state must be contiguous")
    out = torch.empty(b, h, dv, dtype=torch.float32, device=q.device)
    if b:
        grid = (b * h, triton.cdiv(dv, BLOCK_V))
        kernel[grid](q, k, v, g, beta, pool, read.contiguous(), write.contiguous(), out, h, dk, dv, pool.stride(0),
                     BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=BLOCK_V, PER_CHANNEL=g.dim() == 3)
    return out

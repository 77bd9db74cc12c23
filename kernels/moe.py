"""Mixture-of-experts routing and expert dispatch (Mixtral semantics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.linear import linear


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32 over experts, keep the top-k, optionally renormalise to sum 1.

    Returns (weights fp32 [T, k], expert ids [T, k]).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """Run each token through its chosen SwiGLU experts and sum the weighted outputs.

    ``gate_up``/``down`` may hold a contiguous run of the experts, global ids ``first_expert ..``
    (expert parallelism): tokens routed to experts outside the run contribute nothing here.

    ``gate_up`` is [E, 2I, H] (gate rows then up rows), ``down`` is [E, H, I]. Experts are
    visited in ascending id order and accumulated with ``index_add_``, the same order the
    reference uses, so fp32 results agree to the last bits.
    """
    out = torch.zeros_like(x)
    num_experts = gate_up.shape[0]
    hit = torch.unique(ids).tolist()
    for e in hit:
        local = e - first_expert
        if not 0 <= local < num_experts:
            continue
        tok, slot = torch.where(ids == e)
        h = linear(x[tok], gate_up[local])
        gate, up = h.chunk(2, dim=-1)
        h = linear(F.silu(gate) * up, down[local])
        h = h * weights[tok, slot, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out

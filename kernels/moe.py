"""Mixture-of-experts routing and expert dispatch.

Three routers: softmax top-k (Mixtral, Qwen3-MoE), DeepSeek-V3's sigmoid scores with a bias-corrected,
group-limited top-k (the bias only chooses; the weights are the uncorrected scores), and gpt-oss's
softmax over the k best logits. Each returns fp32 weights and expert ids that :func:`moe_experts`
dispatches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from typing import Callable

from strata.kernels.layer_ops import silu_mul
from strata.kernels.linear import linear


def gate_rows_first(t: torch.Tensor) -> torch.Tensor:
    """Rows (dim 1 of a stack) alternating gate, up, gate, ... reordered to every gate row, then every up row:
    the layout :func:`moe_experts` reads, from gpt-oss's interleaved one."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32 over experts, keep the top-k, optionally renormalise to sum 1.

    Returns (weights fp32 [T, k], expert ids [T, k]).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_route_topk_logits(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: the k largest logits choose the experts; a softmax over those k alone weighs them,
    in the logits' dtype as the reference computes it. Returns (weights fp32 [T, k], expert ids [T, k])."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype).float(), ids


def moe_route_grouped(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: sigmoid scores; a group's score is the sum of its two best bias-corrected
    scores; only the ``topk_group`` best groups are eligible; the top-k of the corrected scores there
    choose the experts, weighted by their uncorrected scores (renormalised if asked) times ``scaling``."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    t, e = choice.shape
    group_scores = choice.view(t, n_group, e // n_group).topk(min(2, e // n_group), dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    mask = mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    ids = torch.topk(choice.masked_fill(~mask, float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def moe_route_sqrtsoftplus(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
                           scaling: float, chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 routing: scores sqrt(softplus(logits)) in the logits' dtype; the top-k of the bias-corrected
    scores choose the experts, or ``chosen`` [T, k] does (its hash layers: a fixed expert list per token id);
    the chosen scores, renormalised and times ``scaling``, weigh them (returned in fp32, their values rounded
    as the reference's)."""
    scores = F.softplus(router_logits).sqrt()
    if chosen is None:
        assert correction_bias is not None
        chosen = torch.topk(scores + correction_bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * scaling).float(), chosen


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_mul,
) -> torch.Tensor:
    """Run each token through its chosen SwiGLU experts and sum the weighted outputs.

    ``gate_up``/``down`` may hold a contiguous run of the experts, global ids ``first_expert ..``
    (expert parallelism): tokens routed to experts outside the run contribute nothing here.

    ``gate_up`` is [E, 2I, H] (gate rows then up rows), ``down`` is [E, H, I], their optional biases
    [E, 2I] and [E, H]; ``act`` turns [T, 2I] into [T, I] (SwiGLU unless the family says). Experts are
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
        gu_b = gate_up_bias[local] if gate_up_bias is not None else None
        d_b = down_bias[local] if down_bias is not None else None
        h = linear(act(linear(x[tok], gate_up[local], gu_b)), down[local], d_b)
        h = h * weights[tok, slot, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out

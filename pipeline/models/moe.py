"""Sparse mixture-of-experts feed-forward blocks: routed experts, a router, optional shared experts.

One module for every family in the registry: the router (its kind, ``router_kinds``, finds its arithmetic
in ``ROUTES``), the experts' gate (SwiGLU, or gpt-oss's clamped one with biases) and the shared experts come from
:class:`MoEConfig`. Expert weights are stacked 3-D tensors (the transformers-5 layout); the loader
stacks per-expert checkpoints into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import functools
import re
from typing import Any, Callable

from strata.kernels import moe_experts, moe_route, moe_route_grouped
from strata.kernels.layer_ops import clamped_silu_mul, clamped_swiglu, silu_mul
from strata.kernels.moe import gate_rows_first, moe_route_sqrtsoftplus, moe_route_topk_logits
from strata.pipeline.models.mlp import DenseMLP
from strata.pipeline.models.model_config import MoEConfig, TextConfig
from strata.pipeline.models.router_kinds import RouterKind


_GPT_OSS_EXPERTS = re.compile(r"^layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def interleaved_experts_to_stacked(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """gpt-oss's expert tensors in :class:`MoEExperts`' layout, or None for a tensor that is no expert's.

    gpt-oss keeps its experts as ``x @ W`` ([E, H, 2I] and [E, I, H]) with gate and up columns alternating
    (gate 0, up 0, gate 1, ...); ours are ``W @ x`` with the gate rows first. The transposes are by the
    family, not by shape: real gpt-oss experts are square (I = H = 2880), where a shape tells nothing."""
    m = _GPT_OSS_EXPERTS.match(name)
    if m is None:
        return None
    proj, bias = m.group(1), m.group(2) is not None
    if proj == "gate_up_proj":
        return gate_rows_first(tensor if bias else tensor.transpose(1, 2))  # [E, 2I] or [E, 2I, H]
    return tensor if bias else tensor.transpose(1, 2).contiguous()


class MoEExperts(nn.Module):
    """Expert weights stacked as 3-D tensors: gate_up [E, 2I, H], down [E, H, I] (and gpt-oss's biases,
    [E, 2I] and [E, H])."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None


def _route_softmax(gate: "Router", x: torch.Tensor, token_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    m = gate.moe
    weights, ids = moe_route(F.linear(x, gate.weight), m.experts_per_tok, m.norm_topk_prob)
    return (weights.to(x.dtype).float() if m.router.weights_in_logits_dtype else weights), ids


def _route_sigmoid(gate: "Router", x: torch.Tensor, token_ids: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    m = gate.moe
    logits = F.linear(x.float(), gate.weight) if m.router.scores_fp32 else F.linear(x, gate.weight)
    return moe_route_grouped(logits, gate.e_score_correction_bias, m.experts_per_tok, m.n_group, m.topk_group,
                             m.norm_topk_prob, m.routed_scaling_factor)


def _route_topk_softmax(gate: "Router", x: torch.Tensor, token_ids: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    return moe_route_topk_logits(F.linear(x, gate.weight, gate.bias), gate.moe.experts_per_tok)


def _route_sqrtsoftplus(gate: "Router", x: torch.Tensor, token_ids: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    m = gate.moe
    chosen = None
    if gate.tid2eid is not None:
        if token_ids is None:
            raise ValueError("a hash-routed layer needs the step's token ids")
        chosen = gate.tid2eid[token_ids].long()
    return moe_route_sqrtsoftplus(F.linear(x, gate.weight), getattr(gate, "e_score_correction_bias", None),
                                  m.experts_per_tok, m.routed_scaling_factor, chosen)


# The arithmetic of each router kind (``router_kinds.RouterKind.method``): (fp32 weights [T, k], ids [T, k])
ROUTES = {"softmax": _route_softmax, "sigmoid": _route_sigmoid, "topk-softmax": _route_topk_softmax,
          "sqrtsoftplus": _route_sqrtsoftplus}


class Router(nn.Module):
    """Scores every expert for every token, as its kind (``moe.router``) says. A kind that scores in fp32
    whatever the model dtype (DeepSeek's) sets ``keep_fp32``: the loader leaves its tensors in fp32."""

    def __init__(self, moe: MoEConfig, hidden: int, kind: RouterKind | None = None, vocab_size: int = 0) -> None:
        super().__init__()
        kind = kind or moe.router
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(moe.num_experts)) if kind.logit_bias else None
        if kind.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts))
        # the expert ids each token id routes to (DeepSeek-V4's hash layers): loaded with the weights
        self.tid2eid = nn.Parameter(torch.zeros(vocab_size, moe.experts_per_tok, dtype=torch.int64),
                                    requires_grad=False) if kind.hashed else None
        if kind.scores_fp32:
            self.keep_fp32 = True
        self._route = ROUTES[kind.method]

    def route(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 weights [T, k], expert ids [T, k]); ``token_ids`` [T] for a kind that routes by them."""
        return self._route(self, x, token_ids)


# the activation of each expert kind (``expert_kinds.ExpertKind.method``), given the layer's MoE config
EXPERT_ACTIVATIONS: dict[str, Callable[[Any], Callable[[torch.Tensor], torch.Tensor]]] = {
    "swiglu": lambda moe: silu_mul,
    "clamped-swiglu": lambda moe: functools.partial(clamped_swiglu, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit),
    "clamped-silu": lambda moe: functools.partial(clamped_silu_mul, limit=moe.swiglu_limit),
}


class SparseMoE(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.top_k = moe.experts_per_tok
        self.gate = Router(moe, cfg.hidden_size)
        self.experts = MoEExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, moe.expert_bias)
        self.act = EXPERT_ACTIVATIONS[moe.expert_kind.method](moe)
        self.shared_experts = DenseMLP(cfg.hidden_size, moe.shared_intermediate_size, False) \
            if moe.n_shared_experts else None
        # Qwen3-Next: the shared expert's output is scaled by sigmoid of a linear of the input
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if moe.shared_gate else None

    def forward(self, x: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
        """Routed experts (only ``first_expert ..`` of them when this rank holds a run) plus shared experts."""
        weights, ids = self.gate.route(x)
        e = self.experts
        out = moe_experts(x, e.gate_up_proj, e.down_proj, weights, ids, first_expert, e.gate_up_proj_bias,
                          e.down_proj_bias, self.act)
        if self.shared_experts is not None:
            shared = self.shared_experts.forward(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
            out = out + shared
        return out

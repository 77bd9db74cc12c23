"""Feed-forward blocks of the decoder: dense SwiGLU and Mixtral's sparse MoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import moe_experts, moe_route
from strata.pipeline.models.model_config import TextConfig


def fuse_rows(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding the linears' rows in order; each linear's parameters become
    views of it, so nothing is stored twice and names still resolve."""
    weight = torch.cat([m.weight for m in linears])
    bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


class DenseMLP(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse
        self.gate_up_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        self.gate_up_weight, self.gate_up_bias = fuse_rows(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The unfused reference order (the decoder layer runs the fused form in ``out_proj_mlp``)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEExperts(nn.Module):
    """Expert weights stacked as 3-D tensors (the transformers-5 layout)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class Router(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))


class SparseMoE(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_tok
        self.gate = Router(cfg)
        self.experts = MoEExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe_route(F.linear(x, self.gate.weight), self.top_k)
        return moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)

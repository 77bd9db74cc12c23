"""The decoder's dense SwiGLU feed-forward block (sparse ones are in ``models.moe``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels.quant_weight import QuantWeight, cat_rows
from strata.pipeline.models.quant_modules import QuantLinear


def fuse_rows(*linears: nn.Module) -> tuple[torch.Tensor | QuantWeight, torch.Tensor | None]:
    """One weight (and bias) holding the linears' rows in order; each linear's parameters become
    views of it, so nothing is stored twice and names still resolve. Linears kept quantized fuse in
    their format (each row keeps its scales)."""
    if any(isinstance(m, QuantLinear) for m in linears):
        return _fuse_quantized(linears)
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


def _fuse_quantized(linears: tuple[nn.Module, ...]) -> tuple[QuantWeight, torch.Tensor | None]:
    if not all(isinstance(m, QuantLinear) and m.fmt == linears[0].fmt for m in linears):
        shown = ", ".join(m.fmt.name() if isinstance(m, QuantLinear) else "dense" for m in linears)
        raise ValueError(f"projections fused into one matrix are stored in different formats ({shown}); "
                         "Strata fuses only projections of one format")
    weight = cat_rows([m.weight for m in linears])
    bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
    start = 0
    for m in linears:
        rows = m.out_features
        m.weight = weight.row_range(start, start + rows)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse
        self.gate_up_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        self.gate_up_weight, self.gate_up_bias = fuse_rows(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The unfused reference order (the decoder layer runs the fused form in ``out_proj_mlp``)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

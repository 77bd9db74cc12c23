"""Normalisation layers with the reference's exact op order."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from strata.kernels.layer_ops import bf16_layer_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalise in fp32, cast back, then scale (the order transformers uses); with an
    fp32 weight and narrower x, scale in fp32 and then cast (gpt-oss's order: one rounding, not two).

    In fp32 torch's fused ``rms_norm`` runs the same ops in one call (bit-identical, tested against
    transformers at zero tolerance); other dtypes keep the explicit order, whose cast before the
    scale the fused op does not make.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if weight.dtype == torch.float32:  # gpt-oss's order: scale in fp32, then cast (its weight is held widened)
        h = x.to(torch.float32)
        return (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)
    if x.dim() in (2, 3) and (kernels := bf16_layer_ops(x, weight)) is not None:  # one pass (layer_ops)
        return kernels.rms_norm_bf16(x if x.dim() == 3 else x.unsqueeze(1), weight, eps).view(x.shape)
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_spanning(x: torch.Tensor, weight: torch.Tensor, eps: float, width: int,
                      sum_over_ranks: Callable[[torch.Tensor], torch.Tensor], replicas: int = 1) -> torch.Tensor:
    """:func:`rms_norm` of rows split across tensor-parallel ranks (MiniMax-M2's q/k norm spans every
    head; a rank holds some): each rank's sum of squares is summed over the group (``sum_over_ranks``, an
    all-reduce), divided by the ``replicas`` ranks holding each column (KV heads held twice count once),
    and the mean is over the full ``width``. Same order as :func:`rms_norm`: normalise in fp32, cast,
    scale."""
    h = x.to(torch.float32)
    squares = sum_over_ranks(h.pow(2).sum(-1, keepdim=True)) / replicas
    return weight * (h * torch.rsqrt(squares / width + eps)).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension (CLIP)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

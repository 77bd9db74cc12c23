"""DeepSeek-V4's KV compression: a window of tokens' projections pooled into one entry, and its tail RoPE.

A compressed layer projects every token to a value ``kv`` and a gate. Each closed window of ``m`` tokens
becomes one entry: the softmax over the window (per channel, of gate plus a learned position bias) weighs
the values, the sum is RMS-normed and its trailing RoPE dims rotated at the window's first position.
Heavily compressed attention (HCA, ``m`` = 128) pools each window alone. Compressed sparse attention (CSA,
``m`` = 4) and its indexer project ``2 x`` the width: the first half (Ca) of window ``w - 1``'s tokens and the
second half (Cb) of window ``w``'s are pooled together, so an entry spans ``2m`` tokens with stride ``m``; the
first window of a sequence has no Ca before it (weight 0). Every op in transformers' order and dtypes
(``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor``), so fp32 entries agree to the last bits.
"""

from __future__ import annotations

import torch


def pool_windows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, overlap: bool,
                 prior_kv: torch.Tensor | None = None, prior_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Entries [W, dim] (before the norm) of W closed windows: ``kv`` and ``gate`` [W, m, width] as projected
    (width = dim, or 2 dim with ``overlap``), ``position_bias`` [m, width] fp32. With ``overlap``, ``prior_kv`` /
    ``prior_gate`` [m, width] are the projections of the window before the first (None: the sequence's first)."""
    windows, m, width = kv.shape
    gate = gate + position_bias
    if not overlap:
        return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    dim = width // 2
    pooled_kv = kv.new_zeros((windows, 2 * m, dim))
    pooled_gate = gate.new_full((windows, 2 * m, dim), float("-inf"))
    pooled_kv[:, m:] = kv[..., dim:]
    pooled_gate[:, m:] = gate[..., dim:]
    pooled_kv[1:, :m] = kv[:-1, :, :dim]
    pooled_gate[1:, :m] = gate[:-1, :, :dim]
    if prior_kv is not None and prior_gate is not None:
        pooled_kv[0, :m] = prior_kv[:, :dim].to(kv.dtype)
        pooled_gate[0, :m] = (prior_gate + position_bias)[:, :dim].to(pooled_gate.dtype)
    return (pooled_kv * pooled_gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def pool_each_window(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, overlap: bool,
                     prior_kv: torch.Tensor, prior_gate: torch.Tensor, has_prior: torch.Tensor) -> torch.Tensor:
    """Entries [W, dim] of W windows of different sequences, one each (a decode step's closing windows, pooled
    together): as :func:`pool_windows` on each alone, bit for bit. With ``overlap``, window w's Ca comes from its
    own ``prior_kv`` / ``prior_gate`` [W, m, width] where ``has_prior`` [W] (else: its sequence's first window)."""
    if not overlap:
        return pool_windows(kv, gate, position_bias, overlap)  # windows are pooled independently anyway
    windows, m, width = kv.shape
    dim = width // 2
    gate = gate + position_bias
    pooled_kv = kv.new_zeros((windows, 2 * m, dim))
    pooled_gate = gate.new_full((windows, 2 * m, dim), float("-inf"))
    pooled_kv[:, m:] = kv[..., dim:]
    pooled_gate[:, m:] = gate[..., dim:]
    rows = has_prior.nonzero().squeeze(1)
    pooled_kv[rows, :m] = prior_kv[rows, :, :dim].to(kv.dtype)
    pooled_gate[rows, :m] = (prior_gate[rows] + position_bias)[..., :dim].to(pooled_gate.dtype)
    return (pooled_kv * pooled_gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def rms_norm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V4's RMSNorm: normalised in fp32, scaled by an fp32 weight, then cast back."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V4's weightless RMSNorm (its per-head query norm): the scale computed in fp32, applied in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def tail_rope_cos_sin(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rope_dim / 2] (one per interleaved pair) at ``positions``, rounded to ``dtype`` as the
    reference's rotary does."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D] with its trailing ``2 * cos.shape[-1]`` dims rotated in interleaved pairs (x0, x1), (x2, x3),
    ... by per-token cos/sin [T, rope_dim / 2], in fp32, cast back; the leading dims pass through."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
    c = cos.repeat_interleave(2, dim=-1).view(shape)
    s = sin.repeat_interleave(2, dim=-1).view(shape)
    rope_dim = c.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, ((rope.float() * c) + (rotated.float() * s)).to(x.dtype)], dim=-1)

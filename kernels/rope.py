"""Rotary position embeddings computed from a checkpoint's ``rope_parameters``."""

from __future__ import annotations

import math
from typing import Any

import torch

from strata.kernels.layer_ops import bf16_layer_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency smoothing, as transformers computes it."""
    factor = params["factor"]
    low = params["low_freq_factor"]
    high = params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(head_dim: int, base: float, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (NTK-by-parts) frequencies and the cos/sin scale, as transformers computes them: dimensions
    that rotate fast keep their frequency, slow ones are interpolated by ``factor``, a linear ramp between
    (``beta_fast``/``beta_slow`` rotations over the original context); the attention factor comes from
    ``mscale``/``mscale_all_dim`` when both are given (DeepSeek: they cancel), else from ``factor``."""
    factor = float(params["factor"])
    original = params["original_max_position_embeddings"]
    attention = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None:
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)) if mscale and mscale_all \
            else _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, head_dim, 2, device="cpu").to(torch.float32) / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def mrope_axes(num_freqs: int, sections: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """Which position axis (0 temporal, 1 height, 2 width) rotates each frequency under M-RoPE.

    Qwen2-VL/2.5-VL give the axes consecutive runs of ``sections`` frequencies (t t t h h h w w w);
    Qwen3-VL interleaves them (t h w t h w ... , each axis limited to its section), so every axis
    sees high and low frequencies alike."""
    if len(sections) != 3 or sum(sections) != num_freqs:
        raise ValueError(f"mrope_section {list(sections)} must be three counts summing to {num_freqs} (head_dim / 2)")
    axes = torch.zeros(num_freqs, dtype=torch.int64, device="cpu")
    if interleaved:
        for axis in (1, 2):
            axes[axis : 3 * sections[axis] : 3] = axis
    else:
        axes[sections[0] : sections[0] + sections[1]] = 1
        axes[sections[0] + sections[1] :] = 2
    return axes


def rotary_dim(head_dim: int, rope_parameters: dict[str, Any]) -> int:
    """The dimensions of a head RoPE rotates: all of them, or the first ``partial_rotary_factor`` of them
    (GLM-4.5: half), the rest passing through unrotated, as transformers slices them."""
    factor = float(rope_parameters.get("partial_rotary_factor", 1.0))
    dim = int(head_dim * factor)
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} rotates {dim} of {head_dim} dims: need an even count > 0")
    return dim


class RotaryEmbedding:
    """cos/sin for arbitrary absolute positions, computed on the fly (no table: 1M positions fit).
    Their width is :func:`rotary_dim`: with a partial rotary, :func:`rotate_heads` rotates that many leading
    dims of each head and leaves the rest.

    With ``mrope_section`` (Qwen-VL's multimodal RoPE) positions are [3, T] (temporal, height, width
    per token; a text token has the same value on all three) and each frequency reads its axis."""

    def __init__(self, head_dim: int, rope_parameters: dict[str, Any], mrope_section: tuple[int, ...] = (),
                 mrope_interleaved: bool = False) -> None:
        rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        dim = rotary_dim(head_dim, rope_parameters)
        base = float(rope_parameters.get("rope_theta", 10000.0))
        # Explicit CPU device: models are built under torch.device("meta") before their weights load.
        steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32)
        inv_freq = 1.0 / (base ** (steps / dim))
        if rope_type == "linear":
            inv_freq = inv_freq / float(rope_parameters["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
        scaling = 1.0
        if rope_type == "yarn":
            inv_freq, scaling = _yarn_inv_freq(dim, base, rope_parameters)
        self.inv_freq = inv_freq
        self.attention_scaling = scaling
        self.rope_type = rope_type
        self.mrope_axes = mrope_axes(len(inv_freq), tuple(mrope_section), mrope_interleaved) if mrope_section else None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, rotary dims] for int positions [T] (or [3, T] under M-RoPE)."""
        inv_freq = self.inv_freq.to(positions.device)
        if positions.dim() == 2:
            if self.mrope_axes is None:
                raise ValueError("3-D positions need a model with mrope_section")
            axes = self.mrope_axes.to(positions.device)
            freqs = positions.to(torch.float32)[axes].T * inv_freq[None, :]  # [T, F]: frequency i at axis axes[i]
        else:
            freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by per-token cos/sin [T, R] (half-split convention) over their
    first R dims (R < D: a partial rotary; the rest pass through), as transformers does."""
    c = cos.unsqueeze(1)
    s = sin.unsqueeze(1)
    r = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot = x[..., :r]
        return torch.cat([x_rot * c + _rotate_half(x_rot) * s, x[..., r:]], dim=-1)

    return rotate(q), rotate(k)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: what :func:`rotate_heads` multiplies the swapped halves by."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` for one tensor of heads x [T, H, D] in three ops: rotate_half(x) * sin equals
    swap_halves(x) * signed_sin(sin) product for product (the sign moves from x to sin, exactly), so
    the result is the same to the bit. q and k heads can go through in one call. cos narrower than a head
    (a partial rotary) rotates the head's leading dims and passes the rest through."""
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return torch.cat([rotate_heads(x[..., :rot].contiguous(), cos, sin_signed), x[..., rot:]], dim=-1)
    if x.dim() == 3 and (kernels := bf16_layer_ops(x, cos, sin_signed)) is not None:  # one pass, same bits
        return kernels.rope_bf16(x, cos, sin_signed)
    half = x.shape[-1] // 2
    swapped = x.view(*x.shape[:-1], 2, half).flip(-2).view(x.shape)
    return x * cos.unsqueeze(1) + swapped * sin_signed.unsqueeze(1)


def rotate_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The vision towers' RoPE: x [N, H, D] rotated (half-split) by per-token cos/sin [N, D] in fp32, then
    cast back to x's dtype (the references' order; the decoder's :func:`rotate_heads` stays in its dtype)."""
    xf = x.float()
    return (xf * cos[:, None] + _rotate_half(xf) * sin[:, None]).to(x.dtype)

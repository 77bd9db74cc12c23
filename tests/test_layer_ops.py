"""The one-pass bf16 layer ops (``csrc/layer_ops_cpu.cpp``: RMSNorm, RoPE, SwiGLU's gate) against torch's
eager ops, which are the reference, and their routing.

A bf16 model's norms, rotations and gates run on them on every CPU step: RoPE and the gate must give the
eager ops' bits, RMSNorm the eager bits but for its sum's order (at most one bf16 step, rarely), and a
row must not depend on the rows beside it (batch-invariant greedy answers and speculation rely on it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import rms_norm, rotate_heads
from strata.kernels.cpu_kernels import cpu_kernels
from strata.kernels.layer_ops import bf16_layer_ops, eager_layer_ops, silu_mul

_KERNELS = cpu_kernels()
pytestmark = pytest.mark.skipif(_KERNELS is None, reason="no C++ toolchain here")


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _eager_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in bf16: normalise in fp32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _one_bf16_step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where a and b differ by at most one bf16 rounding step of their magnitude."""
    step = b.float().abs() * 2.0**-7 + torch.finfo(torch.bfloat16).tiny
    return (a.float() - b.float()).abs() <= step


@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (3, 64), (5, 13), (300, 576), (2, 100)])
def test_rms_norm_is_the_eager_norm_up_to_its_sums_order(rows: int, dim: int) -> None:
    x, w = _randn(rows, dim, seed=dim, scale=3.0), _randn(dim, seed=dim + 1)
    out = rms_norm(x, w, 1e-5)
    ref = _eager_rms_norm(x, w, 1e-5)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert _one_bf16_step(out, ref).all()
    assert (out != ref).float().mean() < 1e-3  # the sum's order flips a rounding only now and then


def test_rms_norm_over_a_strided_view_of_heads() -> None:
    """Qwen3's q/k norm runs over a view of the fused q/k/v output: rows of a head's width, strided."""
    t, hq, hkv, d = 4, 6, 2, 32
    qkv = _randn(t, (hq + 2 * hkv) * d, seed=7).view(t, hq + 2 * hkv, d)
    w = _randn(d, seed=8)
    view = qkv[:, hq : hq + hkv]
    assert not view.is_contiguous()
    assert _one_bf16_step(rms_norm(view, w, 1e-6), _eager_rms_norm(view, w, 1e-6)).all()


@pytest.mark.parametrize(("t", "heads", "dim"), [(1, 15, 64), (37, 4, 128), (5, 3, 8), (4, 2, 100)])
def test_rope_gives_the_eager_ops_bits(t: int, heads: int, dim: int) -> None:
    """On the q/k heads' view of the fused projection (strided), for head sizes on and off the vector width."""
    fused = _randn(t, heads + 3, dim, seed=dim + t, scale=4.0)
    x = fused[:, 1 : 1 + heads]
    cos, sin = _randn(t, dim, seed=1), _randn(t, dim, seed=2)
    out = rotate_heads(x, cos, sin)
    with eager_layer_ops():
        ref = rotate_heads(x, cos, sin)
    assert out.is_contiguous() and torch.equal(out, ref)


@pytest.mark.parametrize(("t", "inter"), [(1, 1536), (9, 64), (3, 20), (64, 1536)])
def test_swiglu_gate_gives_the_eager_ops_bits(t: int, inter: int) -> None:
    gate_up = _randn(t, 2 * inter, seed=inter + t, scale=6.0)
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, -88.2, 88.5, float("inf"), float("-inf")])
    gate_up[-1, 1] = float("nan")
    out = silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    same = (out == ref) | (out.isnan() & ref.isnan())
    assert out.shape == (t, inter) and same.all()


def test_a_row_is_computed_the_same_alone_or_in_a_batch() -> None:
    x, w = _randn(64, 576, seed=3), _randn(576, seed=4)
    cos, sin = _randn(64, 64, seed=5), _randn(64, 64, seed=6)
    heads, gate_up = _randn(64, 9, 64, seed=7), _randn(64, 3072, seed=8)
    for i in (0, 17, 63):
        assert torch.equal(rms_norm(x[i : i + 1], w, 1e-5), rms_norm(x, w, 1e-5)[i : i + 1])
        assert torch.equal(rotate_heads(heads[i : i + 1], cos[i : i + 1], sin[i : i + 1]),
                           rotate_heads(heads, cos, sin)[i : i + 1])
        assert torch.equal(silu_mul(gate_up[i : i + 1]), silu_mul(gate_up)[i : i + 1])


def test_the_kernels_take_bf16_only_and_fp32_keeps_the_exact_ops() -> None:
    """fp32 equals transformers at zero tolerance through torch's own ops; the kernels never see it."""
    assert bf16_layer_ops(torch.empty(2, 8, dtype=torch.bfloat16)) is _KERNELS
    assert bf16_layer_ops(torch.empty(2, 8)) is None
    assert bf16_layer_ops(torch.empty(8, 2, dtype=torch.bfloat16).T) is None  # last dimension strided
    with eager_layer_ops():
        assert bf16_layer_ops(torch.empty(2, 8, dtype=torch.bfloat16)) is None
    x, w = torch.randn(3, 64), torch.randn(64)
    assert torch.equal(rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6))
    with pytest.raises(RuntimeError, match="bf16 CPU tensor"):
        _KERNELS.silu_mul_bf16(torch.randn(2, 8))

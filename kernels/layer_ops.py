"""Which bf16 layer ops run as one C++ pass (``csrc/layer_ops_cpu.cpp``) instead of torch's eager ops.

RMSNorm, RoPE and the SwiGLU gate are 3-8 eager ops each; in bf16 every op widens, rounds and writes a
whole tensor, so at prefill sizes they cost more than the GEMMs, and at decode sizes each op's dispatch
is most of their time. The kernels round to bf16 where the eager ops do: RoPE and SwiGLU are
bit-identical to them (tested), RMSNorm differs only in the order of its sum of squares. fp32 keeps
the eager ops, which equal transformers' at zero tolerance; under ``torch.compile`` inductor fuses them.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType
from typing import Iterator

import torch
import torch.nn.functional as F

from strata.kernels.cpu_kernels import cpu_kernels

_allowed = True


def bf16_layer_ops(*tensors: torch.Tensor) -> ModuleType | None:
    """The compiled kernels when every tensor is a bf16 CPU tensor with a contiguous last dimension
    (and no graph is being traced), else None: the caller runs the eager ops."""
    if not _allowed or torch.compiler.is_compiling():
        return None
    for t in tensors:
        if t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.stride(-1) != 1:
            return None
    return cpu_kernels()


@contextmanager
def eager_layer_ops() -> Iterator[None]:
    """Run the eager ops instead (benchmarks compare the two; tests hold the kernels to them)."""
    global _allowed
    before, _allowed = _allowed, False
    try:
        yield
    finally:
        _allowed = before


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate of a fused gate/up projection [T, 2I]: ``silu(gate) * up`` as [T, I]."""
    if gate_up.dim() == 2 and (kernels := bf16_layer_ops(gate_up)) is not None:
        return kernels.silu_mul_bf16(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def clamped_silu_mul(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's expert gate of a fused gate/up projection [T, 2I]: the gate clamped from above and the up
    from both sides at ``limit``, then ``silu(gate) * up`` as [T, I], in the reference's order."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert gate of a fused gate/up projection [T, 2I] (gate columns, then up): the gate clamped
    from above and the up from both sides at ``limit``, ``gate * sigmoid(alpha * gate) * (up + 1)`` as [T, I].
    Every op in the reference's order, so fp32 results agree to the last bit."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))

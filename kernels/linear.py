"""Linear layers for the decoder: weight-streaming kernels for decode batches on the CPU.

With a few tokens per step a linear layer is bound by reading its weights; on the CPU this project
is measured on, torch's GEMM path reads them at ~11 GB/s while ``csrc/small_linear_cpu.cpp`` streams
them at ~30 GB/s (near the machine's copy bandwidth), which is most of a batch-1 decode step. In
bf16 on a CPU with AMX, ``csrc/amx_linear_cpu.cpp`` takes up to :data:`AMX_ROWS` rows on the tile
unit, where the vector kernel would be bound by its FMAs and torch's GEMM by reordering W every call.
An fp32 W past those rows, up to :data:`GEMM_ROWS`, goes to ``csrc/dequant_gemm_cpu.cpp`` (a few rows of W
copied into cache at a time and multiplied by x^T in registers): level with torch's fp32 GEMM on a layer's
shapes, about 2x on a wide one such as a 49K-row LM head, which torch's GEMM reads at a third of the
memory's speed. bf16 stays with torch there (its bf16 dot products are ~2x the FMA kernel on AVX512-BF16).
Larger batches, other devices, and code being traced by ``torch.compile`` use ``F.linear``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
import torch.nn.functional as F

from strata.kernels.cpu_kernels import cpu_kernels
from strata.kernels.quant_linear import quant_linear
from strata.kernels.quant_weight import QuantWeight

SMALL_ROWS = 8  # most rows of x the streaming kernel takes (beyond it, GEMM blocking wins)
GEMM_ROWS = 64  # most rows of fp32 x the C++ GEMM takes (at 64 it is 1.3x torch's on SmolLM2's shapes; then level)
AMX_ROWS = 32  # most rows of bf16 x the AMX kernel takes (W streamed once; from 64 rows torch's GEMM is faster)
_NO_BIAS = torch.empty(0)
_amx_allowed = True


@functools.cache
def _amx_kernels() -> ModuleType | None:
    """The compiled kernels when they can run AMX bf16 tiles in this process, else None."""
    kernels = cpu_kernels()
    return kernels if kernels is not None and kernels.amx_bf16_available() else None


def amx_in_use() -> bool:
    """Whether bf16 decode linears run on AMX tiles in this process."""
    return _amx_allowed and _amx_kernels() is not None


@contextmanager
def without_amx() -> Iterator[None]:
    """Linears as a CPU without AMX runs them (the vector kernel, torch's GEMM), for side-by-side benchmarks."""
    global _amx_allowed
    saved, _amx_allowed = _amx_allowed, False
    try:
        yield
    finally:
        _amx_allowed = saved


_gemm_allowed = True


@contextmanager
def with_torch_gemm() -> Iterator[None]:
    """fp32 linears past the streaming kernel's rows through torch's GEMM (the C++ GEMM off), for
    side-by-side benchmarks."""
    global _gemm_allowed
    saved, _gemm_allowed = _gemm_allowed, False
    try:
        yield
    finally:
        _gemm_allowed = saved


def _amx_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_amx_allowed and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.shape[0] <= AMX_ROWS
            and weight.shape[1] % 32 == 0 and weight.shape[0] % 16 == 0)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2-D ``x``; the streaming kernel when it applies; a weight kept
    quantized is dequantized tile by tile inside the product (``kernels.quant_linear``)."""
    if isinstance(weight, QuantWeight):
        return quant_linear(x, weight, bias)
    if (x.dim() == 2 and x.device.type == "cpu" and weight.is_contiguous()
            and weight.dtype in (torch.float32, torch.bfloat16) and not torch.compiler.is_compiling()):
        b = _NO_BIAS if bias is None else bias.float()
        if _amx_applies(x, weight) and (amx := _amx_kernels()) is not None:
            return amx.amx_bf16_linear(x.contiguous(), weight, b).to(x.dtype)
        if x.shape[0] <= SMALL_ROWS and (kernels := cpu_kernels()) is not None:
            return kernels.small_linear(x.float().contiguous(), weight, b).to(x.dtype)
        if (_gemm_allowed and x.shape[0] <= GEMM_ROWS and x.dtype == torch.float32 and weight.dtype == torch.float32
                and (kernels := cpu_kernels()) is not None):
            return kernels.dense_gemm_linear(x.contiguous(), weight, b)
    return F.linear(x, weight, bias)

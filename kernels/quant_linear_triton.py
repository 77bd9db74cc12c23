"""``x @ W^T + b`` for a weight kept quantized, on CUDA: one Triton kernel that widens W's codes tile by tile
inside the product (FP8 blocks or rows, INT4 groups, MXFP4, GGUF's q4_0 / q4_1 / q8_0 blocks), so no
dequantized W is ever written to memory, whatever the model's size.

A program owns a ``BLOCK_M x BLOCK_N`` tile of y. It walks K in ``BLOCK_K`` steps, and at each step loads
x's tile and the codes of W's tile (with their scales, zero points or block headers), widens them to
fp32 in registers exactly as :meth:`kernels.quant_weight.QuantWeight.tile` defines, and accumulates one
``tl.dot`` in fp32. An fp32 x takes IEEE fp32 dots, so the fp32 reference is met to summation order;
bf16/fp16 x rounds the widened tile to its dtype for tensor-core dots, as the dense bf16 path rounds
its weights. Codes are decoded with integer ops and exact powers of two built from bits, never from
float8 loads or ``exp2``, so the interpreter and every GPU compute the same values.

Tested against the torch reference on CPU under ``TRITON_INTERPRET=1`` (set before Triton is imported).
On CUDA, :func:`kernels.quant_linear.quant_linear` sends every quantized product here. ``torch._scaled_mm``
is not used: its FP8 scales are per tensor or per row, and the releases' 128x128 block scales would need
Hopper's blockwise variant, which this machine cannot test.
"""

from __future__ import annotations

import torch

from strata.kernels.quant_weight import (
    GGML_KINDS,
    FP8BlockWeight,
    FP8RowWeight,
    GGMLBlockWeight,
    Int4GroupWeight,
    MXFP4Weight,
    QuantWeight,
)
from strata.kernels.triton_import import triton_kernel

FP8_BLOCK, FP8_ROW, INT4, MXFP4, GGML = range(5)  # the kernel's FORMAT
BLOCK_N, BLOCK_K = 64, 64


def _load():
    return triton_kernel("quant_linear_triton_kernel", "quant_matmul_kernel")


def supports(weight: QuantWeight) -> bool:
    """Whether the kernel computes ``weight`` (2-D, its tensors laid out as the formats store them)."""
    return not weight.lead() and isinstance(weight, (FP8BlockWeight, FP8RowWeight, Int4GroupWeight, MXFP4Weight,
                                                     GGMLBlockWeight))


def triton_quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight.dequantize(x.dtype), bias)`` for 2-D ``x`` in one launch (the Triton kernel)."""
    triton, kernel = _load()
    m, k = x.shape
    n = weight.rows
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    empty = torch.empty(0, dtype=torch.int32, device=x.device)
    zero, row_block, block_rows, block_cols, group, kind = empty, empty, 1, 1, 1, 0
    if isinstance(weight, FP8BlockWeight):
        fmt, codes, scale = FP8_BLOCK, weight.codes.contiguous().view(torch.uint8), weight.scale.contiguous()
        block_rows, block_cols = weight.block_rows, weight.block_cols
        row_block = empty if weight.row_block is None else weight.row_block.contiguous()
    elif isinstance(weight, FP8RowWeight):
        fmt, codes, scale = FP8_ROW, weight.codes.contiguous().view(torch.uint8), weight.scale.float().contiguous()
    elif isinstance(weight, Int4GroupWeight):
        fmt, codes, scale, group = INT4, weight.packed.contiguous(), weight.scale.contiguous(), weight.group
        zero = empty if weight.zero is None else weight.zero.contiguous()
    elif isinstance(weight, MXFP4Weight):
        fmt, codes, scale = MXFP4, weight.packed.contiguous(), weight.scale.contiguous()
    elif isinstance(weight, GGMLBlockWeight):
        fmt, codes, scale, kind = GGML, weight.data.contiguous(), empty, GGML_KINDS.index(weight.kind)
    else:
        raise TypeError(f"no Triton kernel for {type(weight).__name__}")
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    kernel[grid](x, codes, scale, zero, row_block, bias if bias is not None else empty, y, m, n, k,
                 x.stride(0), codes.stride(0), scale.stride(0) if scale.dim() == 2 else 0,
                 zero.stride(0) if zero.dim() == 2 else 0, y.stride(0), block_rows, block_cols, group,
                 FORMAT=fmt, KIND=kind, HAS_ZERO=zero.numel() > 0, HAS_RB=row_block.numel() > 0,
                 HAS_BIAS=bias is not None, EXACT=x.dtype == torch.float32,
                 BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y

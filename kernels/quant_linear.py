"""``x @ W^T`` for a weight kept quantized, never expanded whole.

* Up to 8 rows on the CPU (decode): ``csrc/quant_linear_cpu.cpp`` streams the codes and widens them in
  registers (FP8 blocks, INT4 groups, MXFP4, GGUF's q4_0/q4_1/q8_0 blocks), so a step reads one byte a
  weight, or half of one, not four.
* 9 to ``GEMM_ROWS`` rows on the CPU (bigger decode batches, speculative verification, short chunks): the
  same entry points run ``csrc/dequant_gemm_cpu.cpp``, a GEMM whose packing step is the dequantization:
  a few rows of W at a time are widened into a buffer that stays in cache and multiplied by every row of
  x there, so a weight is widened once a call and nothing dequantized reaches memory.
* On CUDA: one Triton kernel widens the codes inside the product (``quant_linear_triton``).
* Otherwise (prefill, other devices): each tile of rows (a few MB of the compute dtype) is dequantized
  from the stored codes and multiplied by torch's GEMM, so memory holds the quantized model plus one
  tile, whatever the model's size. On the CPU the tile comes from the same C++ file in one pass
  (``*_dequant``), bit for bit the tile :meth:`QuantWeight.tile` computes with torch ops; that torch
  path, :func:`tiled_linear` with ``kernels=False``, is the reference everything is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.cpu_kernels import cpu_kernels
from strata.kernels.quant_linear_triton import supports, triton_quant_linear
from strata.kernels.triton_import import triton_importable
from strata.kernels.quant_weight import GGML_KINDS, FP8BlockWeight, GGMLBlockWeight, Int4GroupWeight, MXFP4Weight, QuantWeight

TILE_ELEMENTS = 1 << 20  # weights dequantized per tile: 4 MB in fp32, L2/L3-sized
GEMM_ROWS = 128  # most rows the C++ GEMM takes: past it torch's GEMM on dequantized tiles is as fast or faster
_NONE = torch.empty(0)


def tile_rows(cols: int) -> int:
    """Rows per tile: a multiple of 128 (FP8 block rows fall in one tile) unless the matrix is narrower."""
    rows = max(1, TILE_ELEMENTS // max(1, cols))
    return max(128, rows // 128 * 128)


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight.dequantize(x.dtype), bias)`` for 2-D ``x``, never holding more than one tile."""
    if x.device.type == "cuda" and triton_importable() and supports(weight) and not torch.compiler.is_compiling():
        return triton_quant_linear(x, weight, bias)
    streamed = _stream(x, weight, bias)
    if streamed is not None:
        return streamed
    return tiled_linear(x, weight, bias)


def tiled_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None,
                 kernels: bool = True) -> torch.Tensor:
    """Dequantize a tile of rows, multiply, next tile (``kernels=False``: the tiles from torch ops only)."""
    step = tile_rows(weight.cols)
    if weight.rows <= step:
        return F.linear(x, dequantize_rows(weight, 0, weight.rows, x.dtype, kernels), bias)
    out = torch.empty(x.shape[0], weight.rows, dtype=x.dtype, device=x.device)
    for r0 in range(0, weight.rows, step):
        r1 = min(weight.rows, r0 + step)
        out[:, r0:r1] = F.linear(x, dequantize_rows(weight, r0, r1, x.dtype, kernels))
    return out if bias is None else out + bias


def dequantize_rows(weight: QuantWeight, r0: int, r1: int, dtype: torch.dtype, kernels: bool = True) -> torch.Tensor:
    """Rows ``r0 .. r1`` of ``weight`` in ``dtype``: the C++ pass on the CPU where it applies, else ``tile``."""
    lib = cpu_kernels() if kernels and weight.device.type == "cpu" and not torch.compiler.is_compiling() else None
    if lib is None:
        return weight.tile(r0, r1, dtype)
    if isinstance(weight, FP8BlockWeight) and weight.codes.is_contiguous():
        row_block = _NONE if weight.row_block is None else weight.row_block
        tile = lib.fp8_block_dequant(weight.codes, weight.scale, row_block, weight.block_rows, weight.block_cols, r0, r1)
    elif isinstance(weight, Int4GroupWeight) and weight.group % 8 == 0 and weight.packed.is_contiguous():
        zero = _NONE if weight.zero is None else weight.zero.contiguous()
        tile = lib.int4_group_dequant(weight.packed, weight.scale.contiguous(), zero, weight.group, weight.cols, r0, r1)
    elif isinstance(weight, MXFP4Weight) and weight.packed.is_contiguous() and weight.scale.is_contiguous():
        tile = lib.mxfp4_dequant(weight.packed, weight.scale, r0, r1)
    elif isinstance(weight, GGMLBlockWeight) and weight.data.is_contiguous():
        tile = lib.ggml_block_dequant(weight.data, GGML_KINDS.index(weight.kind), weight.cols, r0, r1)
    else:
        return weight.tile(r0, r1, dtype)
    return tile.to(dtype)


def _stream(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The C++ kernels' answer (streaming up to 8 rows, the GEMM past them up to ``GEMM_ROWS``) when
    one applies (None: use the tiles)."""
    if not 0 < x.shape[0] <= GEMM_ROWS or x.dim() != 2 or x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    kernels = cpu_kernels()
    if kernels is None:
        return None
    b = _NONE if bias is None else bias.float().contiguous()
    xf = x.float().contiguous()
    if isinstance(weight, FP8BlockWeight) and weight.codes.is_contiguous() and weight.block_cols % 4 == 0:
        row_block = _NONE if weight.row_block is None else weight.row_block
        y = kernels.fp8_block_linear(xf, weight.codes, weight.scale, row_block, weight.block_rows, weight.block_cols, b)
    elif isinstance(weight, Int4GroupWeight) and weight.group % 8 == 0 and weight.packed.is_contiguous():
        zero = _NONE if weight.zero is None else weight.zero.contiguous()
        y = kernels.int4_group_linear(xf, weight.packed, weight.scale.contiguous(), zero, weight.group, b)
    elif isinstance(weight, MXFP4Weight) and weight.packed.is_contiguous() and weight.scale.is_contiguous():
        y = kernels.mxfp4_linear(xf, weight.packed, weight.scale, b)
    elif isinstance(weight, GGMLBlockWeight) and weight.data.is_contiguous():
        y = kernels.ggml_block_linear(xf, weight.data, GGML_KINDS.index(weight.kind), b)  # the C++ numbering
    else:
        return None
    return y.to(x.dtype)

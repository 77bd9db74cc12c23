"""Quantized weights the kernel tests share: every layout the CPU and Triton kernels tell apart, with the
exact dequantization each is checked against."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from strata.kernels.quant_weight import (FP8BlockWeight, GGMLBlockWeight, Int4GroupWeight, MXFP4Weight, QuantWeight,
                                         cat_rows)
from strata.pipeline.models.weight_formats import FP8Block


def fp8_block_case(rows: int, cols: int, bm: int, bn: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, the exact dequantization): every element times the scale of the block it is in."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(rows, cols, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-rows // bm), -(-cols // bn), generator=g) + 0.01
    exact = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            exact[i, j] = codes[i, j].float() * scale[i // bm, j // bn]
    return codes, scale, exact


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7] -> int32 words, eight per word, element i at bits 4i (as q + 8)."""
    rows, cols = q.shape
    padded = F.pad(q.to(torch.int64) + 8, (0, -cols % 8)).view(rows, -1, 8)
    words = sum(padded[..., i] << (4 * i) for i in range(8))
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def int4_weight_case(rows: int, cols: int, group: int, symmetric: bool, seed: int) -> Int4GroupWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8)
    groups = -(-cols // group)
    scale = (torch.rand(rows, groups, generator=g) + 0.05).to(torch.bfloat16)
    zero = None if symmetric else torch.randint(-8, 8, (rows, groups), generator=g, dtype=torch.int8)
    return Int4GroupWeight(rows, cols, pack_int4(q), scale, zero, group)


def mxfp4_weight_case(rows: int, cols: int, seed: int) -> MXFP4Weight:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    return MXFP4Weight(rows, cols, packed, torch.randint(118, 134, (rows, cols // 32), generator=g, dtype=torch.uint8))


def ggml_weight_case(kind: str, rows: int, cols: int, seed: int) -> tuple[GGMLBlockWeight, torch.Tensor]:
    """Rows quantized by gguf-py (llama.cpp's Python reference), and gguf-py's own dequantization of them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy()
    qtype = getattr(GGMLQuantizationType, kind.upper())
    data = quantize(values, qtype)
    return GGMLBlockWeight(rows, cols, torch.from_numpy(data.copy()), kind), torch.from_numpy(dequantize(data, qtype))


def streamed_weights() -> list[QuantWeight]:
    """One of each layout the streaming kernels tell apart: FP8 blocks with partial blocks both ways and a
    partial 32-column chunk, fused FP8 rows, 64-wide blocks, and blocks of 16 and 48 (narrower than a chunk,
    or not a whole number of chunks: each lane takes its own block's scale); INT4 groups of 32 (bf16 and fp32 scales,
    symmetric or not, a partial chunk of 8), of 128, and of a width that is neither (24, 96); MXFP4 with a
    last group of 32 past the 64-wide chunks; GGUF's q4_0, q4_1 and q8_0 blocks."""
    codes, scale, _ = fp8_block_case(200, 300, 128, 128, seed=5)
    fp8 = FP8Block(128, 128).build("w", 200, 300, {"weight": codes, "weight_scale_inv": scale})
    codes2, scale2, _ = fp8_block_case(70, 300, 128, 128, seed=6)
    fused = cat_rows([fp8, FP8Block(128, 128).build("w2", 70, 300, {"weight": codes2, "weight_scale_inv": scale2})])
    codes3, scale3, _ = fp8_block_case(40, 200, 64, 64, seed=9)
    codes4, scale4, _ = fp8_block_case(40, 200, 16, 16, seed=16)
    codes5, scale5, _ = fp8_block_case(40, 200, 48, 48, seed=17)
    int4_fp32_scales = int4_weight_case(48, 256, 32, True, 10)
    int4_fp32_scales = replace(int4_fp32_scales, scale=int4_fp32_scales.scale.float())
    return [fp8, fused, FP8BlockWeight(40, 200, codes3, scale3, 64, 64),
            FP8BlockWeight(40, 200, codes4, scale4, 16, 16), FP8BlockWeight(40, 200, codes5, scale5, 48, 48),
            int4_weight_case(96, 328, 32, True, 7), int4_weight_case(96, 328, 32, False, 11), int4_fp32_scales,
            int4_weight_case(64, 256, 128, False, 8), int4_weight_case(40, 264, 24, False, 12),
            int4_weight_case(40, 392, 96, True, 13),
            mxfp4_weight_case(80, 96, 14), mxfp4_weight_case(48, 512, 15),
            *(ggml_weight_case(kind, 40, 160, seed=21 + i)[0] for i, kind in enumerate(("q4_0", "q4_1", "q8_0")))]

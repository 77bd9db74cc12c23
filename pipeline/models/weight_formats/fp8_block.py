"""FP8 e4m3 weights with one float32 scale per ``block_rows x block_cols`` block: DeepSeek-V3/V3.1/V3.2,
Kimi-K2, GLM-4.5 and MiniMax-M2 as released (``quant_method: fp8``, ``weight_scale_inv``), and
compressed-tensors' ``float-quantized`` block strategy (``weight_scale``), and DeepSeek-V4 (``scale``, each a
power of two stored as ``float8_e8m0fnu``). The last block of a row or
a column may be partial (DeepSeek's ``kv_a_proj_with_mqa`` has 576 rows: four and a half blocks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.quant_weight import FP8BlockWeight
from strata.pipeline.models.weight_formats.format import (
    WeightFormat,
    aligned,
    ceil_div,
    check_dtype,
    check_shape,
)


@dataclass(frozen=True)
class FP8Block(WeightFormat):
    block_rows: int = 128
    block_cols: int = 128
    scale_suffix: str = "weight_scale_inv"

    def name(self) -> str:
        return f"fp8-e4m3-block{self.block_rows}x{self.block_cols}"

    def suffixes(self) -> tuple[str, ...]:
        return "weight", self.scale_suffix

    def marker(self) -> str:
        return self.scale_suffix

    def bytes_per_weight(self, cols: int) -> float:
        return 1.0 + 4.0 / (self.block_rows * self.block_cols)

    def build(self, name: str, rows: int, cols: int, parts: dict[str, torch.Tensor]) -> FP8BlockWeight:
        codes, scale = parts["weight"], parts[self.scale_suffix]
        check_dtype(f"{name}.weight", codes, torch.float8_e4m3fn)
        check_shape(f"{name}.weight", codes, (rows, cols))
        check_dtype(f"{name}.{self.scale_suffix}", scale, torch.float32, torch.bfloat16, torch.float8_e8m0fnu)
        check_shape(f"{name}.{self.scale_suffix}", scale,
                    (ceil_div(rows, self.block_rows), ceil_div(cols, self.block_cols)))
        return FP8BlockWeight(rows, cols, codes.contiguous(), scale.float().contiguous(), self.block_rows,
                              self.block_cols)

    def part_slice(self, name: str, suffix: str, dim: int, start: int, stop: int) -> tuple[int, int, int] | None:
        unit = self.block_rows if dim == 0 else self.block_cols
        aligned(f"{name}.{suffix}", "row" if dim == 0 else "column", start, unit)
        if suffix == "weight":
            return dim, start, stop
        return dim, start // unit, ceil_div(stop, unit)

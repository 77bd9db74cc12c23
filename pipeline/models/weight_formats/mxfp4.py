"""MXFP4 weights (OCP microscaling): e2m1 codes two to a byte and one E8M0 scale byte per 32 inputs, as
compressed-tensors' ``mxfp4-pack-quantized`` stores them (``weight_packed`` uint8 [rows, cols / 2],
``weight_scale`` uint8 [rows, cols / 32]). gpt-oss, Kimi-K3 and DeepSeek-V4 ship their experts in the
same encoding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.quant_weight import MXFP4Weight
from strata.pipeline.models.weight_formats.format import (
    WeightFormat,
    WeightFormatError,
    aligned,
    check_dtype,
    check_shape,
)

GROUP = MXFP4Weight.GROUP


@dataclass(frozen=True)
class MXFP4(WeightFormat):
    def name(self) -> str:
        return "mxfp4-e2m1-group32"

    def suffixes(self) -> tuple[str, ...]:
        return "weight_packed", "weight_scale"

    def marker(self) -> str:
        return "weight_packed"

    def bytes_per_weight(self, cols: int) -> float:
        return 0.5 + 1.0 / GROUP

    def build(self, name: str, rows: int, cols: int, parts: dict[str, torch.Tensor]) -> MXFP4Weight:
        if cols % GROUP:
            raise WeightFormatError(f"tensor {name}.weight_packed: {cols} inputs are not a whole number of "
                                    f"MXFP4 groups of {GROUP}")
        packed, scale = parts["weight_packed"], parts["weight_scale"]
        check_dtype(f"{name}.weight_packed", packed, torch.uint8)
        check_shape(f"{name}.weight_packed", packed, (rows, cols // 2))
        check_dtype(f"{name}.weight_scale", scale, torch.uint8)
        check_shape(f"{name}.weight_scale", scale, (rows, cols // GROUP))
        return MXFP4Weight(rows, cols, packed.contiguous(), scale.contiguous())

    def part_slice(self, name: str, suffix: str, dim: int, start: int, stop: int) -> tuple[int, int, int] | None:
        if dim == 0:
            return 0, start, stop
        aligned(f"{name}.{suffix}", "column", start, GROUP)
        per = 2 if suffix == "weight_packed" else GROUP
        return 1, start // per, -(-stop // per)

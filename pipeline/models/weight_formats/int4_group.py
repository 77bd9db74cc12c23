"""INT4 weights in compressed-tensors' ``pack-quantized`` format: eight 4-bit values per int32 word along
the input dim (stored as ``q + 8``), a scale per group of inputs, and a zero point per group when
asymmetric (packed eight per word along the output dim). Kimi-K2-Thinking and Kimi-K2.5 ship their
routed experts so (groups of 32, bf16 scales, symmetric)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata.kernels.quant_weight import Int4GroupWeight, unpack_int4_rows
from strata.pipeline.models.weight_formats.format import (
    WeightFormat,
    WeightFormatError,
    aligned,
    ceil_div,
    check_dtype,
    check_shape,
)

PER_WORD = 8  # 4-bit values per int32


@dataclass(frozen=True)
class Int4Group(WeightFormat):
    group_size: int = 32
    symmetric: bool = True

    def name(self) -> str:
        return f"int4-group{self.group_size}-{'sym' if self.symmetric else 'asym'}"

    def suffixes(self) -> tuple[str, ...]:
        base = ("weight_packed", "weight_scale", "weight_shape")
        return base if self.symmetric else (*base, "weight_zero_point")

    def marker(self) -> str:
        return "weight_packed"

    def bytes_per_weight(self, cols: int) -> float:
        return 0.5 + 2.0 / self.group_size + (0.0 if self.symmetric else 0.5 / self.group_size)

    def build(self, name: str, rows: int, cols: int, parts: dict[str, torch.Tensor]) -> Int4GroupWeight:
        packed, scale, shape = parts["weight_packed"], parts["weight_scale"], parts["weight_shape"]
        groups = ceil_div(cols, self.group_size)
        check_dtype(f"{name}.weight_packed", packed, torch.int32)
        check_shape(f"{name}.weight_packed", packed, (rows, ceil_div(cols, PER_WORD)))
        check_dtype(f"{name}.weight_scale", scale, torch.bfloat16, torch.float16, torch.float32)
        check_shape(f"{name}.weight_scale", scale, (rows, groups))
        if shape.numel() != 2 or shape.dtype.is_floating_point:
            raise WeightFormatError(f"tensor {name}.weight_shape must hold two integers, not {tuple(shape.shape)}")
        zero = None
        if not self.symmetric:
            packed_zero = parts["weight_zero_point"]
            check_dtype(f"{name}.weight_zero_point", packed_zero, torch.int32)
            check_shape(f"{name}.weight_zero_point", packed_zero, (ceil_div(rows, PER_WORD), groups))
            zero = unpack_int4_rows(packed_zero, rows)  # one byte per group: a fused or split row keeps its own
        return Int4GroupWeight(rows, cols, packed.contiguous(), scale.contiguous(), zero, self.group_size)

    def check_shape_tensor(self, name: str, shape: torch.Tensor, rows: int, cols: int) -> None:
        """``weight_shape`` is the whole matrix's (rows, cols), whatever slice of it a rank reads."""
        if [int(v) for v in shape.reshape(-1)] != [rows, cols]:
            raise WeightFormatError(f"tensor {name}.weight_shape says {[int(v) for v in shape.reshape(-1)]}, "
                                    f"the config implies {[rows, cols]}")

    def part_slice(self, name: str, suffix: str, dim: int, start: int, stop: int) -> tuple[int, int, int] | None:
        if suffix == "weight_shape":
            return None
        if dim == 0:
            if suffix == "weight_zero_point":
                aligned(f"{name}.{suffix}", "row", start, PER_WORD)
                return 0, start // PER_WORD, ceil_div(stop, PER_WORD)
            return 0, start, stop
        unit = math.lcm(self.group_size, PER_WORD)
        aligned(f"{name}.{suffix}", "column", start, unit)
        per = PER_WORD if suffix == "weight_packed" else self.group_size
        return 1, start // per, ceil_div(stop, per)

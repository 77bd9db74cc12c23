"""FP8 e4m3 weights with a float32 scale per output row (per-channel) or one per tensor: compressed-tensors'
``float-quantized`` format with the channel or tensor strategy, as many community FP8 releases ship."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.quant_weight import FP8RowWeight
from strata.pipeline.models.weight_formats.format import WeightFormat, check_dtype, check_shape, WeightFormatError


@dataclass(frozen=True)
class FP8Row(WeightFormat):
    per_channel: bool = True

    def name(self) -> str:
        return "fp8-e4m3-per-" + ("channel" if self.per_channel else "tensor")

    def suffixes(self) -> tuple[str, ...]:
        return "weight", "weight_scale"

    def marker(self) -> str:
        return "weight_scale"

    def bytes_per_weight(self, cols: int) -> float:
        return 1.0 + (4.0 / cols if self.per_channel else 0.0)

    def build(self, name: str, rows: int, cols: int, parts: dict[str, torch.Tensor]) -> FP8RowWeight:
        codes, scale = parts["weight"], parts["weight_scale"]
        check_dtype(f"{name}.weight", codes, torch.float8_e4m3fn)
        check_shape(f"{name}.weight", codes, (rows, cols))
        check_dtype(f"{name}.weight_scale", scale, torch.float32, torch.bfloat16, torch.float16)
        if self.per_channel:
            if scale.numel() != rows:
                raise WeightFormatError(f"tensor {name}.weight_scale holds {scale.numel()} scales; "
                                        f"per-channel FP8 needs one per row ({rows})")
            per_row = scale.reshape(rows).float()
        else:
            check_shape(f"{name}.weight_scale", scale.reshape(-1), (1,))
            per_row = scale.reshape(1).float().expand(rows)
        return FP8RowWeight(rows, cols, codes.contiguous(), per_row.contiguous())

    def part_slice(self, name: str, suffix: str, dim: int, start: int, stop: int) -> tuple[int, int, int] | None:
        if suffix == "weight":
            return dim, start, stop
        return (0, start, stop) if dim == 0 and self.per_channel else None

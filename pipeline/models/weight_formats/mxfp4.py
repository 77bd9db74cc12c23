"""MXFP4 weights (OCP microscaling): e2m1 codes two to a byte and one E8M0 scale byte per 32 inputs, as
compressed-tensors' ``mxfp4-pack-quantized`` stores them (``weight_packed`` uint8 [rows, cols / 2],
``weight_scale`` uint8 [rows, cols / 32]). gpt-oss, Kimi-K3 and DeepSeek-V4 ship their experts in the
same encoding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.moe import gate_rows_first
from strata.kernels.quant_weight import MXFP4Weight
from strata.pipeline.models.weight_formats.format import (
    WeightFormat,
    WeightFormatError,
    aligned,
    check_dtype,
    check_shape,
)

GROUP = MXFP4Weight.GROUP
GPT_OSS_SUFFIXES = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


@dataclass(frozen=True)
class MXFP4(WeightFormat):
    """compressed-tensors' names and dtypes by default; DeepSeek-V4's experts hold the same bytes as
    ``weight`` (int8) and ``scale`` (``float8_e8m0fnu``), read as the unsigned bytes they are."""

    packed_suffix: str = "weight_packed"
    scale_suffix: str = "weight_scale"

    def name(self) -> str:
        return "mxfp4-e2m1-group32"

    def suffixes(self) -> tuple[str, ...]:
        return self.packed_suffix, self.scale_suffix

    def marker(self) -> str:
        return self.scale_suffix if self.packed_suffix == "weight" else self.packed_suffix

    def bytes_per_weight(self, cols: int) -> float:
        return 0.5 + 1.0 / GROUP

    def build(self, name: str, rows: int, cols: int, parts: dict[str, torch.Tensor]) -> MXFP4Weight:
        if cols % GROUP:
            raise WeightFormatError(f"tensor {name}.{self.packed_suffix}: {cols} inputs are not a whole number of "
                                    f"MXFP4 groups of {GROUP}")
        packed_name, scale_name = f"{name}.{self.packed_suffix}", f"{name}.{self.scale_suffix}"
        packed, scale = parts[self.packed_suffix], parts[self.scale_suffix]
        check_dtype(packed_name, packed, torch.uint8, torch.int8)
        check_shape(packed_name, packed, (rows, cols // 2))
        check_dtype(scale_name, scale, torch.uint8, torch.float8_e8m0fnu)
        check_shape(scale_name, scale, (rows, cols // GROUP))
        return MXFP4Weight(rows, cols, packed.view(torch.uint8).contiguous(), scale.view(torch.uint8).contiguous())

    def part_slice(self, name: str, suffix: str, dim: int, start: int, stop: int) -> tuple[int, int, int] | None:
        if dim == 0:
            return 0, start, stop
        aligned(f"{name}.{suffix}", "column", start, GROUP)
        per = 2 if suffix == self.packed_suffix else GROUP
        return 1, start // per, -(-stop // per)


@dataclass(frozen=True)
class MXFP4Experts(WeightFormat):
    """gpt-oss's release (``quant_method: mxfp4``): a layer's whole stack of experts in MXFP4, the 16 bytes of
    a group on a dim of their own (``gate_up_proj_blocks`` [E, 2I, H / 32, 16], ``_scales`` [E, 2I, H / 32],
    the same for ``down_proj``), gate and up rows alternating. The bytes are :class:`MXFP4Weight`'s; only
    the rows are put gate-first, as every stack of experts here is."""

    def name(self) -> str:
        return "mxfp4-e2m1-group32 (gpt-oss expert blocks)"

    def suffixes(self) -> tuple[str, ...]:
        return GPT_OSS_SUFFIXES

    def marker(self) -> str:
        return "gate_up_proj_blocks"

    def bytes_per_weight(self, cols: int) -> float:
        return 0.5 + 1.0 / GROUP

    def build(self, name: str, rows: int, cols: int, parts: dict[str, torch.Tensor]) -> MXFP4Weight:
        raise WeightFormatError(f"tensor {name}.gate_up_proj_blocks: gpt-oss's MXFP4 blocks hold a stack of experts, "
                                "not one linear")

    def part_slice(self, name: str, suffix: str, dim: int, start: int, stop: int) -> tuple[int, int, int] | None:
        return None  # experts are split whole (expert parallelism), never by rows or columns

    def build_experts(self, name: str, experts: int, hidden: int, intermediate: int,
                      parts: dict[str, torch.Tensor]) -> tuple[MXFP4Weight, MXFP4Weight]:
        """(gate_up [E, 2I, H] gate rows first, down [E, H, I]) of this rank's ``experts``."""
        out = []
        for proj, rows, cols in (("gate_up_proj", 2 * intermediate, hidden), ("down_proj", hidden, intermediate)):
            if cols % GROUP:
                raise WeightFormatError(f"tensor {name}.{proj}_blocks: {cols} inputs are not a whole number of "
                                        f"MXFP4 groups of {GROUP}")
            blocks, scales = parts[f"{proj}_blocks"], parts[f"{proj}_scales"]
            check_dtype(f"{name}.{proj}_blocks", blocks, torch.uint8)
            check_shape(f"{name}.{proj}_blocks", blocks, (experts, rows, cols // GROUP, GROUP // 2))
            check_dtype(f"{name}.{proj}_scales", scales, torch.uint8)
            check_shape(f"{name}.{proj}_scales", scales, (experts, rows, cols // GROUP))
            packed = blocks.reshape(experts, rows, cols // 2)
            if proj == "gate_up_proj":
                packed, scales = gate_rows_first(packed), gate_rows_first(scales)
            out.append(MXFP4Weight(rows, cols, packed.contiguous(), scales.contiguous()))
        return out[0], out[1]

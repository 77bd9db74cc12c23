"""GGUF's legacy block formats (``q4_0``, ``q4_1``, ``q8_0``): each row of a tensor a run of 32-weight
blocks, a block its fp16 scale (and minimum) before its codes, kept as llama.cpp wrote them.

A GGUF is read into a checkpoint directory that holds these rows byte for byte
(:mod:`pipeline.models.gguf_source`): ``X.weight_q4_1`` is the uint8 matrix [rows, cols / 32 * 20] of
linear (or embedding) ``X``. The tensor's name says its block type, so the marker is the type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.quant_weight import GGML_KINDS, GGMLBlockWeight
from strata.pipeline.models.weight_formats.format import (
    WeightFormat,
    WeightFormatError,
    aligned,
    check_dtype,
    check_shape,
)

GROUP = GGMLBlockWeight.GROUP


@dataclass(frozen=True)
class GGMLBlock(WeightFormat):
    kind: str = "q4_1"

    def __post_init__(self) -> None:
        if self.kind not in GGML_KINDS:
            raise ValueError(f"no GGML block format {self.kind!r}")

    @property
    def block_bytes(self) -> int:
        return GGMLBlockWeight.BLOCK_BYTES[self.kind]

    def name(self) -> str:
        return f"gguf-{self.kind}"

    def suffixes(self) -> tuple[str, ...]:
        return (self.marker(),)

    def marker(self) -> str:
        return f"weight_{self.kind}"

    def bytes_per_weight(self, cols: int) -> float:
        return self.block_bytes / GROUP

    def build(self, name: str, rows: int, cols: int, parts: dict[str, torch.Tensor]) -> GGMLBlockWeight:
        if cols % GROUP:
            raise WeightFormatError(f"tensor {name}.{self.marker()}: {cols} inputs are not a whole number of "
                                    f"blocks of {GROUP}")
        data = parts[self.marker()]
        check_dtype(f"{name}.{self.marker()}", data, torch.uint8)
        check_shape(f"{name}.{self.marker()}", data, (rows, cols // GROUP * self.block_bytes))
        return GGMLBlockWeight(rows, cols, data.contiguous(), self.kind)

    def part_slice(self, name: str, suffix: str, dim: int, start: int, stop: int) -> tuple[int, int, int] | None:
        if dim == 0:
            return 0, start, stop
        aligned(f"{name}.{suffix}", "column", start, GROUP)
        return 1, start // GROUP * self.block_bytes, -(-stop // GROUP) * self.block_bytes

"""What every weight format declares: its checkpoint tensors, how they shard, their size, its ``ops`` line.

A format is a component kind like an attention kind: the loader, ``strata ops``, the planner and the
tensor-parallel shard plan all ask the same object, so what ``ops`` says is what the loader does.
Each format turns one linear's checkpoint tensors into a :class:`kernels.quant_weight.QuantWeight`
that stays in its stored encoding in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.quant_weight import QuantWeight


class WeightFormatError(ValueError):
    """A quantized tensor that does not fit its format (dtype, shape, a split off a block boundary)."""


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WeightFormat:
    """One storage format of a linear weight (the dense formats need none: a plain tensor is dense)."""

    def name(self) -> str:
        """Short and stable (``fp8-block128x128``): the ``ops`` table and the planner show it."""
        raise NotImplementedError

    def suffixes(self) -> tuple[str, ...]:
        """The checkpoint tensors of one linear in this format (``weight``, ``weight_scale_inv``, ...)."""
        raise NotImplementedError

    def marker(self) -> str:
        """The suffix whose presence in the checkpoint says a linear is stored in this format."""
        raise NotImplementedError

    def bytes_per_weight(self, cols: int) -> float:
        """Resident bytes per weight of a matrix ``cols`` wide, scales included (the planner's figure)."""
        raise NotImplementedError

    def kernel(self) -> str:
        """What computes it here (the ``ops`` table's "implemented by")."""
        return "dequantized tile by tile inside the matmul (kernels.quant_linear)"

    def build(self, name: str, rows: int, cols: int, parts: dict[str, torch.Tensor]) -> QuantWeight:
        """The weight of a ``rows x cols`` linear from its checkpoint tensors (this rank's slices of them);
        :class:`WeightFormatError` naming ``name`` when they do not fit."""
        raise NotImplementedError

    def part_slice(self, name: str, suffix: str, dim: int, start: int, stop: int) -> tuple[int, int, int] | None:
        """The slice of tensor ``suffix`` holding weight rows (``dim`` 0) or columns (``dim`` 1)
        ``start .. stop`` (None: read it whole); a split that cuts a block or a
        group is refused, naming the tensor."""
        raise NotImplementedError


def check_dtype(name: str, tensor: torch.Tensor, *allowed: torch.dtype) -> None:
    if tensor.dtype not in allowed:
        shown = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise WeightFormatError(f"tensor {name} is {str(tensor.dtype).removeprefix('torch.')}; its format stores {shown}")


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise WeightFormatError(f"tensor {name}: checkpoint shape {tuple(tensor.shape)} != {shape} its format implies")


def aligned(name: str, what: str, start: int, unit: int) -> None:
    """A rank's slice must start on a ``unit`` boundary: its first row or column then reads its own block's
    scale, and every later one follows (a slice may end mid-block: its last block is partial, as at a
    matrix's end)."""
    if start % unit:
        raise WeightFormatError(f"tensor {name}: a tensor-parallel split at {what} {start} cuts a {unit}-wide "
                                "quantization block; choose a size whose shards start on block boundaries")

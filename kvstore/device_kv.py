"""The device pool's tensors: one per cache group, and a view per model layer for attention to read.

A group's tensor is ``[num_blocks, group layers, kv_parts, block_size, kv_heads, head_dim]`` in the group's
dtype; block ``b`` of every group together is block ``b`` of the pool. What crosses to the tiers is a
block's *bytes*: each group's block in order (``KVLayout.slot_offsets``), which :func:`split_block` and
:func:`join_block` convert to and from the per-group tensors.
"""

from __future__ import annotations

from typing import Sequence

import torch

from strata.kvstore.layout import KVLayout


class DeviceKV:
    """Per-group pool tensors and per-layer views of them."""

    def __init__(self, layout: KVLayout, num_blocks: int | Sequence[int], device: str | torch.device = "cpu") -> None:
        """``num_blocks``: rows of every group's tensor, or of each (a sliding-window group keeps fewer:
        ``window_slots``)."""
        rows = [num_blocks] * len(layout.groups) if isinstance(num_blocks, int) else list(num_blocks)
        self.layout = layout
        self.groups = [torch.zeros(n, g.num_layers, *g.layer_shape(layout.block_size), dtype=g.dtype, device=device)
                       for n, g in zip(rows, layout.groups, strict=True)]
        # layers[i]: [num_blocks, kv_parts, block_size, heads, head_dim], a view of model layer i's group tensor
        self.layers = [self.groups[gi][:, j] for gi, j in map(layout.group_of, range(layout.num_layers))]

    @property
    def device(self) -> torch.device:
        return self.groups[0].device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.groups)

    def block_nbytes(self) -> int:
        """This process's bytes of one block (one rank's heads under tensor parallelism)."""
        return sum(t[0].numel() * t.element_size() for t in self.groups)

    def block(self, rows: Sequence[int]) -> list[torch.Tensor]:
        """One block of every group (views), at each group's row (``BlockPool.storage_ids``)."""
        if min(rows) < 0:
            raise ValueError("a part of this block is not on the device")
        return [t[r] for t, r in zip(self.groups, rows, strict=True)]

    def write(self, rows: Sequence[int], parts: Sequence[torch.Tensor]) -> None:
        """Write one block's parts; a group whose row is -1 (no slot on the device) is skipped."""
        for t, r, part in zip(self.groups, rows, parts, strict=True):
            if r >= 0:
                t[r].copy_(part)


def split_block(layout: KVLayout, flat: torch.Tensor) -> list[torch.Tensor]:
    """A whole block's bytes (uint8 [bytes_per_block], CPU) as one tensor per group (views)."""
    out, start = [], 0
    for g in layout.groups:
        n = g.num_layers * g.layer_nbytes(layout.block_size)
        out.append(flat[start : start + n].view(g.dtype).view(g.num_layers, *g.layer_shape(layout.block_size)))
        start += n
    return out


def join_block(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-group blocks -> one contiguous uint8 CPU tensor (the bytes the tiers store)."""
    return torch.cat([p.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for p in parts])

"""Attention over spilled blocks: a sequence's oldest blocks live in a lower tier, and each layer's K and V
of them stream back through a fixed staging buffer, a segment of ``staging_blocks`` at a time.

A block still cached on the device is copied from there; the rest is read from the first tier with a
good copy (one ``pread`` per layer, checksummed). A block in no tier raises :class:`KVBlockLostError`,
and the engine recomputes the sequences that read it. On CUDA the next segment's file reads and copy
overlap the current segment's compute (``StagingBuffers.prefetch``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from strata.kvstore.block_pool import BlockPool
from strata.kvstore.layout import KVLayout
from strata.kvstore.lower_tiers import LowerTiers
from strata.kvstore.staging import StagingBuffers


class KVBlockLostError(RuntimeError):
    """A spilled block could not be read back from any tier (the sequence must be recomputed)."""

    def __init__(self, block_hash: bytes) -> None:
        super().__init__(f"KV block {block_hash.hex()[:16]}… is in no tier")
        self.block_hash = block_hash


def bytes_view(t: torch.Tensor) -> np.ndarray:
    """uint8 numpy view of a contiguous CPU tensor (works for bf16, which numpy lacks)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class SpilledReader:
    """Per-layer reads of spilled blocks into the staging buffer (``TieredKVCache`` holds one)."""

    def __init__(self, pool: BlockPool, lower: LowerTiers | None, layout: KVLayout, staging_blocks: int) -> None:
        if staging_blocks < 1:
            raise ValueError("staging_blocks must be >= 1")
        self.pool, self.lower, self.layout, self.staging_blocks = pool, lower, layout, staging_blocks
        # one staging buffer per layer geometry: groups shaped alike (full and sliding layers) share one
        self._stages: dict[tuple, StagingBuffers] = {}
        for g in layout.groups:
            key = (g.layer_shape(layout.block_size), g.dtype)
            if key not in self._stages:
                self._stages[key] = StagingBuffers((staging_blocks, *key[0]), g.dtype, pool.kv.device)
        self._stage_of = [self._stages[(g.layer_shape(layout.block_size), g.dtype)]
                          for g in (layout.groups[layout.group_of(i)[0]] for i in range(layout.num_layers))]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._stages.values())

    def load(self, hashes: Sequence[bytes], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for up to ``staging_blocks`` spilled blocks, as [n, bs, H, D] views of a
        staging buffer (valid until the next load)."""
        n = len(hashes)
        if n > self.staging_blocks:
            raise ValueError(f"{n} blocks exceed the staging buffer ({self.staging_blocks})")
        on_device = {i: self.pool.lookup(h) for i, h in enumerate(hashes)}
        on_device = {i: b for i, b in on_device.items() if b is not None}

        def read(host: torch.Tensor) -> None:
            for i, h in enumerate(hashes):
                if i not in on_device:
                    self._read_layer(h, host[i], layer)

        def patch(dev: torch.Tensor) -> None:
            for i, block_id in on_device.items():
                dev[i].copy_(self.pool.kv.layers[layer][block_id])

        stage = self._stage_of[layer].get((tuple(hashes), layer), n, read, patch)
        return stage[:, 0], stage[:, -1]

    def prefetch(self, hashes: Sequence[bytes], layer: int) -> None:
        """Start staging a later segment (CUDA: file reads and the copy overlap the current compute)."""
        def read_all(host: torch.Tensor) -> None:
            for i, h in enumerate(hashes):
                self._read_layer(h, host[i], layer)

        self._stage_of[layer].prefetch((tuple(hashes), layer), len(hashes), read_all)

    def _read_layer(self, block_hash: bytes, out: torch.Tensor, layer: int) -> None:
        slot = self.layout.slot_of(layer)
        if self.lower is None or not self.lower.read_layers(block_hash, bytes_view(out), slot, 1):
            raise KVBlockLostError(block_hash)


class SpilledBlocks:
    """A sequence's spilled blocks as the attention kernels see them (``kernels.SpilledKV``)."""

    def __init__(self, reader: SpilledReader, hashes: Sequence[bytes]) -> None:
        self.reader = reader
        self.hashes = list(hashes)
        self.num_blocks = len(self.hashes)
        self.segment_blocks = reader.staging_blocks
        self.block_size = reader.layout.block_size

    def load(self, layer: int, first_block: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.reader.load(self.hashes[first_block : first_block + num_blocks], layer)

    def prefetch(self, layer: int, first_block: int, num_blocks: int) -> None:
        self.reader.prefetch(self.hashes[first_block : first_block + num_blocks], layer)

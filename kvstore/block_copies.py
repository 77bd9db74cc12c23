"""Block copies between the device pool and the lower tiers: publishing with write-through, making sure
a tier holds a block before the device lets it go, and promoting a tier's block back to the device.

Every path that moves a block's bytes across the device boundary goes through here, so the byte view
of a block (all layers, the whole block under tensor parallelism) is taken in one place.
"""

from __future__ import annotations

from typing import Sequence

import torch

from strata.kvstore.block_pool import BlockPool, NoFreeBlocksError
from strata.kvstore.block_table import BlockTable
from strata.kvstore.device_blocks import DeviceBlocks
from strata.kvstore.layout import KVLayout
from strata.kvstore.lower_tiers import LowerTiers
from strata.kvstore.spilled_reads import bytes_view


class BlockCopies:
    """Publish, write through, ensure below, promote: the device pool and the tier chain under it."""

    def __init__(self, pool: BlockPool, lower: LowerTiers | None, blocks: DeviceBlocks, layout: KVLayout) -> None:
        self.pool = pool
        self.lower = lower
        self.blocks = blocks
        self._host_block = torch.empty(layout.bytes_per_block(), dtype=torch.uint8)  # promotion scratch

    def block_bytes(self, block_id: int) -> memoryview:
        """A device block as the tiers store it (every layer; every rank's heads under tp)."""
        return memoryview(bytes_view(self.blocks.read(block_id)))

    def publish(self, table: BlockTable, hashes: Sequence[bytes], end: int) -> None:
        """Publish the table's blocks up to ``end`` under ``hashes``: a block whose content is already
        cached is swapped for the cached one; a new one is written through to the top lower tier."""
        ids = table.block_ids
        written: list[tuple[bytes, memoryview]] = []
        for i in range(table.num_published, end):
            j = i - table.num_spilled
            canonical = self.pool.publish(ids[j], hashes[i])
            if canonical != ids[j]:  # same content already cached: share it, drop our copy
                self.pool.incref(canonical)
                for w in self.pool.windows.values():  # our claim (and, if the copy has none, our part) moves over
                    w.transfer(ids[j], canonical)
                self.pool.free(ids[j])
                ids[j] = canonical
            elif self.lower is not None and not self.lower.top.contains(hashes[i]):
                written.append((hashes[i], self.block_bytes(canonical)))
            table.hashes.append(hashes[i])
        if written:
            self.lower.store_behind(written)  # type: ignore[union-attr]

    def ensure_below(self, block_hash: bytes) -> bool:
        """Make sure a lower tier holds ``block_hash`` (writing it from the device if needed)."""
        if self.lower is None:
            return False
        if self.lower.ensure(block_hash):  # below already, or its queued write-through landed just now
            return True
        block_id = self.pool.lookup(block_hash)
        if block_id is None or not self.pool.complete(block_id):  # a windowed part is gone: no whole block here
            return False
        return self.lower.store([(block_hash, self.block_bytes(block_id))])[0]

    def promote(self, block_hash: bytes) -> int | None:
        """Copy a lower-tier block into a fresh, published device block; None if no room or no good copy."""
        if self.lower is None:
            return None
        try:
            block_id = self.pool.allocate()
        except NoFreeBlocksError:
            return None
        for w in self.pool.windows.values():  # an idle slot for each windowed part, where one is free
            w.lend(block_id)
        if not self.lower.read_block(block_hash, bytes_view(self._host_block)):
            self.pool.free(block_id)
            return None
        self.blocks.write(block_id, self._host_block)
        self.pool.publish(block_id, block_hash)
        return block_id

"""Whole-block reads and writes of the device pool: how KV crosses between the device and the tiers.

A block in a tier file always holds every KV head of every cache group, as bytes (``device_kv.join_block``).
In one process the device pool does too, so a read or a write is a copy. A tensor-parallel stage holds
each block's heads spread over its ranks; it passes an implementation that gathers them from, or scatters
them to, the group (``pipeline.core.tp_runner.ShardedDeviceBlocks``), and the tiers, hashes and handles
never notice.
"""

from __future__ import annotations

import torch

from strata.kvstore.block_pool import BlockPool
from strata.kvstore.device_kv import join_block, split_block


class DeviceBlocks:
    """Reads and writes whole blocks of a pool that holds every KV head."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def read(self, block_id: int) -> torch.Tensor:
        """Block ``block_id`` as the tiers store it: contiguous uint8 CPU bytes, every group in order
        (every part must be on the device: ``BlockPool.complete``)."""
        return join_block(self.pool.kv.block(self.pool.storage_ids(block_id)))

    def write(self, block_id: int, block: torch.Tensor) -> None:
        """Overwrite block ``block_id`` with ``block`` (its uint8 bytes, as :meth:`read` returns them); a
        windowed part with no slot on the device is left out."""
        self.pool.kv.write(self.pool.storage_ids(block_id), split_block(self.pool.layout, block))

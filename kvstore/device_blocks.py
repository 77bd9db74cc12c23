"""Whole-block reads and writes of the device pool: how KV crosses between the device and the tiers.

A block in a tier file always holds every KV head. In one process the device pool does too, so a
read or a write is a copy. A tensor-parallel stage holds each block's heads spread over its ranks;
it passes an implementation that gathers them from, or scatters them to, the group
(``pipeline.tp_runner.ShardedDeviceBlocks``), and the tiers, hashes and handles never notice.
"""

from __future__ import annotations

import torch

from strata.kvstore.block_pool import BlockPool


class DeviceBlocks:
    """Reads and writes whole blocks of a pool that holds every KV head."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def read(self, block_id: int) -> torch.Tensor:
        """Block ``block_id`` as a contiguous CPU tensor of the full block shape."""
        return self.pool.kv[block_id].cpu().contiguous()

    def write(self, block_id: int, block: torch.Tensor) -> None:
        """Overwrite block ``block_id`` with ``block`` (full block shape, any device)."""
        self.pool.kv[block_id].copy_(block)

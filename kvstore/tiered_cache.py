"""The device pool plus the lower tiers, operated on per-sequence block tables.

This is what lets a context outgrow the device: a sequence's oldest full blocks can be
*spilled* (dropped from the device, pinned in a lower tier) and attention streams them
back layer by layer through a fixed staging buffer. A prefix found in a lower tier is
promoted into device blocks while they last; the rest of it stays spilled.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvstore.block_pool import BlockPool, NoFreeBlocksError
from kvstore.block_table import BlockTable
from kvstore.lower_tiers import LowerTiers


class KVBlockLostError(RuntimeError):
    """A spilled block could not be read back from any tier (the sequence must be recomputed)."""

    def __init__(self, block_hash: bytes) -> None:
        super().__init__(f"KV block {block_hash.hex()[:16]}… is in no tier")
        self.block_hash = block_hash


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    """uint8 numpy view of a contiguous CPU tensor (works for bf16, which numpy lacks)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class TieredKVCache:
    """Block pool (device tier) + optional host/disk chain + the staging buffer for streaming."""

    def __init__(self, pool: BlockPool, lower: LowerTiers | None = None, staging_blocks: int = 64) -> None:
        if staging_blocks < 1:
            raise ValueError("staging_blocks must be >= 1")
        self.pool = pool
        self.lower = lower
        self.layout = pool.layout
        self.staging_blocks = staging_blocks
        lay = self.layout
        shape = (staging_blocks, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)
        device = pool.kv.device
        self._host_stage = torch.empty(shape, dtype=lay.dtype, pin_memory=device.type == "cuda")
        self._device_stage = self._host_stage if device.type == "cpu" else torch.empty(shape, dtype=lay.dtype, device=device)
        self._host_block = torch.empty(lay.block_shape(), dtype=lay.dtype)  # promotion scratch
        self.prefix_queried_blocks = 0
        self.prefix_hit_blocks = {"device": 0, **({t.name: 0 for t in lower.tiers} if lower else {})}
        self.spilled_blocks = 0  # blocks currently spilled by running sequences (gauge)
        self._pins: dict[bytes, int] = {}  # sequences of this process reading each spilled block
        self.peak_spilled_blocks = 0

    @property
    def can_spill(self) -> bool:
        return self.lower is not None

    def staging_nbytes(self) -> int:
        return self._device_stage.numel() * self._device_stage.element_size()

    # ------------------------------------------------------------ publish / write-through
    def publish(self, table: BlockTable, hashes: Sequence[bytes], first: int, end: int) -> None:
        """Publish logical blocks [first, end) of ``table`` under ``hashes``; write new ones through."""
        ids = table.block_ids
        written: list[tuple[bytes, memoryview]] = []
        for i in range(first, end):
            j = i - table.num_spilled
            canonical = self.pool.publish(ids[j], hashes[i])
            if canonical != ids[j]:  # same content already cached: share it, drop our copy
                self.pool.incref(canonical)
                self.pool.free(ids[j])
                ids[j] = canonical
            elif self.lower is not None and not self.lower.top.contains(hashes[i]):
                written.append((hashes[i], self._block_bytes(canonical)))
        if written:
            self.lower.store(written)  # type: ignore[union-attr]

    def _block_bytes(self, block_id: int) -> memoryview:
        return memoryview(_bytes_view(self.pool.kv[block_id].cpu().contiguous()))

    def _ensure_lower(self, block_hash: bytes) -> bool:
        """Make sure a lower tier holds ``block_hash`` (writing it from the device if needed)."""
        assert self.lower is not None
        if self.lower.find(block_hash) is not None:
            return True
        block_id = self.pool.lookup(block_hash)
        return block_id is not None and self.lower.store([(block_hash, self._block_bytes(block_id))])[0]

    # ------------------------------------------------------------ prefix match over tiers
    def match_prefix(self, table: BlockTable, hashes: Sequence[bytes], reserve: int) -> int:
        """Adopt the longest cached leading run of ``hashes`` into the empty ``table``.

        Device hits are referenced, lower-tier hits are promoted into device blocks while more
        than ``reserve`` blocks stay free, and the oldest blocks beyond that stay spilled
        (pinned below). Returns the number of blocks matched.
        """
        assert not table.block_ids and table.num_spilled == 0
        self.prefix_queried_blocks += len(hashes)
        where: list[str] = []
        for h in hashes:
            if self.pool.lookup(h) is not None:
                where.append("device")
                continue
            tier = self.lower.find(h) if self.lower is not None else None
            if tier is None:
                break
            where.append(tier.name)
        m = len(where)
        budget = max(0, self.pool.num_free() - reserve)
        k = max(0, m - budget) if self.lower is not None else 0
        spilled: list[bytes] = []
        for i in range(k):
            if not self._ensure_lower(hashes[i]):
                m = k = i
                break
            spilled.append(hashes[i])
        if spilled:
            self._pin(spilled)
            self.lower.touch(spilled)  # type: ignore[union-attr]
        table.num_spilled = k
        self._add_spilled(k)
        for i in range(k, m):
            block_id = self.pool.lookup(hashes[i])
            if block_id is not None:
                self.pool.incref(block_id)
            else:
                block_id = self._promote(hashes[i])
                if block_id is None:
                    m = i
                    break
            table.block_ids.append(block_id)
        for i in range(m):
            self.prefix_hit_blocks[where[i]] += 1
        table.num_tokens = m * table.block_size
        return m

    def _promote(self, block_hash: bytes) -> int | None:
        """Copy a lower-tier block into a fresh device block; None if no block or no good copy."""
        assert self.lower is not None
        try:
            block_id = self.pool.allocate()
        except NoFreeBlocksError:
            return None
        if not self.lower.read_block(block_hash, _bytes_view(self._host_block)):
            self.pool.free(block_id)
            return None
        self.pool.kv[block_id].copy_(self._host_block)
        self.pool.publish(block_id, block_hash)
        return block_id

    # ------------------------------------------------------------ spill / release
    def spillable(self, table: BlockTable, num_published: int) -> int:
        """Resident blocks that may leave the device: full, published ones."""
        return max(0, num_published - table.num_spilled) if self.lower is not None else 0

    def spill_plan(self, table: BlockTable, num_published: int, want: int) -> tuple[int, int]:
        """(blocks to spill, device blocks that frees): the shortest leading run of spillable blocks
        that frees ``want`` blocks, or all of them. A block other sequences also hold (a shared
        prefix) frees nothing when only this one lets go of it."""
        count = freed = 0
        for block_id in table.block_ids[: self.spillable(table, num_published)]:
            count += 1
            freed += self.pool.ref_count(block_id) == 1
            if freed >= want:
                break
        return count, freed

    def spill(self, table: BlockTable, hashes: Sequence[bytes], n: int) -> int:
        """Drop the ``n`` oldest resident (published) blocks from the device; returns how many left."""
        assert self.lower is not None
        done = 0
        while done < n and table.block_ids:
            h = hashes[table.num_spilled]
            if not self._ensure_lower(h):
                break
            self._pin([h])
            self.pool.free(table.block_ids.pop(0))
            table.num_spilled += 1
            done += 1
        self._add_spilled(done)
        return done

    def _pin(self, hashes: Sequence[bytes]) -> None:
        """Count this process's readers per block; the shared pin is taken by the first one."""
        first = [h for h in hashes if self._pins.get(h, 0) == 0]
        for h in hashes:
            self._pins[h] = self._pins.get(h, 0) + 1
        self.lower.pin(first)  # type: ignore[union-attr]

    def _unpin(self, hashes: Sequence[bytes]) -> None:
        last = []
        for h in hashes:
            n = self._pins[h] - 1
            if n:
                self._pins[h] = n
            else:
                del self._pins[h]
                last.append(h)
        self.lower.unpin(last)  # type: ignore[union-attr]

    def _add_spilled(self, n: int) -> None:
        self.spilled_blocks += n
        self.peak_spilled_blocks = max(self.peak_spilled_blocks, self.spilled_blocks)

    def release(self, table: BlockTable, hashes: Sequence[bytes]) -> None:
        """Drop every reference the table holds: device refs and lower-tier pins."""
        for block_id in reversed(table.block_ids):
            self.pool.free(block_id)
        if table.num_spilled and self.lower is not None:
            self._unpin(hashes[: table.num_spilled])
        self.spilled_blocks -= table.num_spilled
        table.block_ids.clear()
        table.num_spilled = 0
        table.num_tokens = 0

    # ------------------------------------------------------------ streaming reads
    def load_spilled(self, hashes: Sequence[bytes], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer for up to ``staging_blocks`` spilled blocks, as [n, bs, H, D] views
        of the staging buffer (valid until the next call). A block still cached on the device is
        copied from there; the rest is read from the first tier with a good copy."""
        n = len(hashes)
        if n > self.staging_blocks:
            raise ValueError(f"{n} blocks exceed the staging buffer ({self.staging_blocks})")
        host = self._host_stage
        to_copy: list[tuple[int, int]] = []
        for i, h in enumerate(hashes):
            block_id = self.pool.lookup(h)
            if block_id is not None:
                to_copy.append((i, block_id))
            elif self.lower is None or not self.lower.read_layers(h, _bytes_view(host[i]), layer, 1):
                raise KVBlockLostError(h)
        stage = self._device_stage
        if stage is not host:
            stage[:n].copy_(host[:n], non_blocking=True)
        for i, block_id in to_copy:
            stage[i].copy_(self.pool.kv[block_id, layer])
        return stage[:n, 0], stage[:n, 1]

    def stats(self) -> dict[str, object]:
        bs = self.layout.block_size
        device = {k: v for k, v in self.pool.stats().items() if not k.startswith("prefix_")}  # counted here instead
        return {
            "device": device,
            "tiers": self.lower.stats() if self.lower else {},
            "prefix_queried_tokens": self.prefix_queried_blocks * bs,
            "prefix_hit_tokens": {k: v * bs for k, v in self.prefix_hit_blocks.items()},
            "spilled_blocks": self.spilled_blocks,
            "peak_spilled_blocks": self.peak_spilled_blocks,
            "staging_bytes": self.staging_nbytes(),
        }


class SpilledBlocks:
    """A sequence's spilled blocks as the attention kernels see them (``kernels.OffloadedKV``)."""

    def __init__(self, cache: TieredKVCache, hashes: Sequence[bytes]) -> None:
        self.cache = cache
        self.hashes = list(hashes)
        self.num_blocks = len(self.hashes)
        self.segment_blocks = cache.staging_blocks

    def load(self, layer: int, first_block: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.load_spilled(self.hashes[first_block : first_block + num_blocks], layer)

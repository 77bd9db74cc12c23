"""The tiers below the device pool (host, then disk) seen as one chain.

Full blocks are written through to the top lower tier when they are published, so a
device eviction costs nothing, another process can adopt the block by hash, and (with a
disk tier) the prefix cache survives a restart. Each tier demotes its LRU victims to the
next; a hit in a lower tier is copied back up (promotion). With a write queue, write-through and
promotion (and the demotions they cause) run on a background writer (``kvstore.tier_writer``).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from strata.kvstore.file_store import FileBlockStore
from strata.kvstore.layout import KVLayout
from strata.kvstore.tier_prefetch import TierPrefetcher
from strata.kvstore.tier_writer import TierWriter

log = logging.getLogger(__name__)


class LowerTiers:
    """Host and/or disk block stores, top first."""

    def __init__(self, tiers: Sequence[FileBlockStore], write_queue_blocks: int = 0, prefetch_blocks: int = 0) -> None:
        """``write_queue_blocks``: blocks the background writer may hold (0: every write on the caller's
        thread); ``prefetch_blocks``: blocks read ahead for admissions (0: none)."""
        if not tiers:
            raise ValueError("LowerTiers needs at least one tier")
        self.tiers = list(tiers)
        for upper, lower in zip(self.tiers, self.tiers[1:]):  # the chain has this one owner: evictions go down it
            upper.demote = functools.partial(lower.put_many, encoded=True)
        self.layout = tiers[0].layout
        self.write_errors = 0
        self.block_nbytes = self.layout.bytes_per_block()
        self.writer = TierWriter(self._store_now, write_queue_blocks, name=f"kv-{self.top.name}-writer") \
            if write_queue_blocks else None
        self.prefetcher = TierPrefetcher(self._read_block_now, self.block_nbytes, prefetch_blocks,
                                         name=f"kv-{self.top.name}-prefetch") if prefetch_blocks else None

    @classmethod
    def open(
        cls,
        layout: KVLayout,
        fingerprint: bytes,
        host_dir: str | Path | None = None,
        host_blocks: int = 0,
        disk_dir: str | Path | None = None,
        disk_blocks: int = 0,
        write_queue_blocks: int = 0,
        prefetch_blocks: int = 0,
    ) -> "LowerTiers | None":
        """The configured chain, or None when neither tier has capacity."""
        disk = None
        if disk_blocks > 0:
            if disk_dir is None:
                raise ValueError("a disk tier needs a directory")
            disk = FileBlockStore(disk_dir, disk_blocks, layout, fingerprint, name="disk")
        host = None
        if host_blocks > 0:
            if host_dir is None:
                raise ValueError("a host tier needs a directory")
            host = FileBlockStore(host_dir, host_blocks, layout, fingerprint, name="host")
        tiers = [t for t in (host, disk) if t is not None]
        return cls(tiers, write_queue_blocks, prefetch_blocks) if tiers else None

    @property
    def top(self) -> FileBlockStore:
        return self.tiers[0]

    # ------------------------------------------------------------ writes
    def store(self, items: Iterable[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        """Write blocks through to the top tier now (it demotes what no longer fits)."""
        return self._store_now(list(items), False)

    def _store_now(self, items: list[tuple[bytes, bytes | memoryview]], encoded: bool) -> list[bool]:
        """A write that fails (a full /dev/shm: ENOSPC, a permission change) stores nothing and says so:
        write-through is a cache, so the caller keeps the block on the device or recomputes it later."""
        try:
            return self.top.put_many(items, encoded=encoded)
        except OSError as exc:  # TierWriteError included
            self.write_errors += 1
            if self.write_errors == 1 or self.write_errors % 1000 == 0:
                log.warning("KV %s tier write failed (%s); blocks stay uncached there (%d failures so far)",
                            self.top.name, exc.strerror or exc, self.write_errors)
            return [False] * len(items)

    def store_behind(self, items: Iterable[tuple[bytes, bytes | memoryview]], encoded: bool = False) -> None:
        """Write blocks through on the background writer (copies are queued; the caller may reuse its
        buffers at once), or now when there is none. A full queue drops the caching, counted."""
        if self.writer is None:
            self._store_now(list(items), encoded)
        else:
            self.writer.submit(items, encoded)

    def ensure(self, block_hash: bytes) -> bool:
        """Whether a tier holds the block once this returns: one still queued is written now."""
        if self.find(block_hash) is not None:
            return True
        if self.writer is None:
            return False
        queued = self.writer.take(block_hash)
        if queued is None:
            return self.find(block_hash) is not None  # it may have landed while we looked
        return self._store_now([(block_hash, queued[0])], queued[1])[0]

    def pending(self, block_hash: bytes) -> bool:
        """Queued for the background writer (or being written), not landed yet."""
        return self.writer is not None and self.writer.pending(block_hash)

    def wait_for(self, hashes: Sequence[bytes]) -> None:
        """Wait until queued writes of ``hashes`` landed (a hand-off to another pool reads them there)."""
        if self.writer is not None:
            self.writer.wait_for(hashes)

    def flush(self) -> None:
        """Wait until every queued write landed."""
        if self.writer is not None:
            self.writer.flush()

    # ------------------------------------------------------------ lookups
    def find(self, block_hash: bytes) -> FileBlockStore | None:
        for tier in self.tiers:
            if tier.contains(block_hash):
                return tier
        return None

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Refresh the LRU position of blocks just used, in every tier that has them."""
        if hashes:
            for tier in self.tiers:
                tier.touch(hashes)

    def read_layers(self, block_hash: bytes, out: np.ndarray, first_layer: int, num_layers: int) -> bool:
        """Layers of one block from the first tier that has a good copy."""
        return any(t.read_layers(block_hash, out, first_layer, num_layers) for t in self.tiers)

    def read_block(self, block_hash: bytes, out: np.ndarray) -> bool:
        """A whole block into ``out`` (uint8), read ahead or read now; a block found below the top tier is
        promoted to it."""
        if self.prefetcher is not None and self.prefetcher.take(block_hash, out):
            return True
        return self._read_block_now(block_hash, out)

    def prefetch(self, hashes: Sequence[bytes]) -> None:
        """Read these blocks ahead on the prefetch thread (no-op without one)."""
        if self.prefetcher is not None and hashes:
            self.prefetcher.request(hashes)

    def _read_block_now(self, block_hash: bytes, out: np.ndarray) -> bool:
        for i, tier in enumerate(self.tiers):
            if i == 0:
                if tier.read_layers(block_hash, out, 0, self.layout.num_layers):
                    return True
                continue
            blob = tier.read_encoded(block_hash)
            if blob is None:
                continue
            out.reshape(-1)[:] = np.frombuffer(blob, dtype=np.uint8, offset=len(blob) - self.block_nbytes)
            tier.counters["hits"] += 1
            self.store_behind([(block_hash, blob)], encoded=True)  # a failed promotion only loses the copy
            return True
        return False

    # ------------------------------------------------------------ pins
    def pin(self, hashes: Sequence[bytes]) -> None:
        """Keep blocks a running sequence reads from here: no tier may drop them."""
        if hashes:
            for tier in self.tiers:
                tier.pin(hashes)

    def unpin(self, hashes: Sequence[bytes]) -> None:
        if hashes:
            for tier in self.tiers:
                tier.unpin(hashes)

    def stats(self) -> dict[str, dict[str, int]]:
        out = {t.name: t.stats() for t in self.tiers}
        queue = {} if self.writer is None else {
            "write_queue_depth": self.writer.depth(), "write_queue_dropped": self.writer.counters["dropped"]}
        out[self.top.name] = {**out[self.top.name], "write_errors": self.write_errors, **queue}
        return out

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.writer is not None:
            self.writer.close()
        for tier in self.tiers:
            tier.close()

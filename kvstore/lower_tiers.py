"""The tiers below the device pool (host, then disk) seen as one chain.

Full blocks are written through to the top lower tier when they are published, so a
device eviction costs nothing, another process can adopt the block by hash, and (with a
disk tier) the prefix cache survives a restart. Each tier demotes its LRU victims to the
next; a hit in a lower tier is copied back up (promotion).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from strata.kvstore.block_file import BlockFileError, verify_blob
from strata.kvstore.file_store import FileBlockStore, TierWriteError
from strata.kvstore.layout import KVLayout

log = logging.getLogger(__name__)


class LowerTiers:
    """Host and/or disk block stores, top first."""

    def __init__(self, tiers: Sequence[FileBlockStore]) -> None:
        if not tiers:
            raise ValueError("LowerTiers needs at least one tier")
        self.tiers = list(tiers)
        self.layout = tiers[0].layout
        self.write_errors = 0
        self.block_nbytes = self.layout.bytes_per_block()

    @classmethod
    def open(
        cls,
        layout: KVLayout,
        fingerprint: bytes,
        host_dir: str | Path | None = None,
        host_blocks: int = 0,
        disk_dir: str | Path | None = None,
        disk_blocks: int = 0,
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
            host = FileBlockStore(host_dir, host_blocks, layout, fingerprint, name="host", next_tier=disk)
        tiers = [t for t in (host, disk) if t is not None]
        return cls(tiers) if tiers else None

    @property
    def top(self) -> FileBlockStore:
        return self.tiers[0]

    # ------------------------------------------------------------ writes
    def store(self, items: Iterable[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        """Write blocks through to the top tier (it demotes what no longer fits). A write that fails
        (a full /dev/shm: ENOSPC, a permission change) stores nothing and says so: write-through is a
        cache, so the caller keeps the block on the device or recomputes it later."""
        items = list(items)
        try:
            return self.top.put_many(items)
        except OSError as exc:
            self.write_errors += 1
            if self.write_errors == 1 or self.write_errors % 1000 == 0:
                log.warning("KV %s tier write failed (%s); blocks stay uncached there (%d failures so far)",
                            self.top.name, exc.strerror or exc, self.write_errors)
            return [False] * len(items)

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
        """A whole block into ``out`` (uint8); a block found below the top tier is promoted to it."""
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
            try:
                self.top.put_many([(block_hash, blob)], encoded=True)
            except TierWriteError:  # the read succeeded; only the promotion is lost
                self.write_errors += 1
            return True
        return False

    # ------------------------------------------------------------ between nodes
    def missing(self, hashes: Sequence[bytes]) -> list[bytes]:
        """The blocks no tier here holds (what a hand-off from another node must bring along)."""
        return [h for h in hashes if not any(t.contains(h) for t in self.tiers)]

    def read_encoded_many(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """Whole verified block files, from the first tier holding a good copy (None where none does):
        what this node's block server sends to another node."""
        out = []
        for h in hashes:
            out.append(next((blob for t in self.tiers if (blob := t.read_encoded(h)) is not None), None))
        return out

    def import_encoded(self, items: Sequence[tuple[bytes, bytes | None]], fingerprint: bytes) -> tuple[int, int]:
        """Store block files received from another node in the top tier, each verified first (header
        names the block, model and layout; every layer's checksum holds). Returns (stored, rejected);
        a rejected or absent block is simply not here, and its reader recomputes it."""
        good, rejected = [], 0
        for block_hash, blob in items:
            if blob is None:
                continue
            try:
                verify_blob(blob, block_hash, fingerprint, self.layout)
            except BlockFileError:
                rejected += 1
                continue
            good.append((block_hash, blob))
        try:
            stored = sum(self.top.put_many(good, encoded=True)) if good else 0
        except TierWriteError:  # a full tier here: the reader recomputes what was not stored
            self.write_errors += 1
            stored = 0
        return stored, rejected

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
        out[self.top.name] = {**out[self.top.name], "write_errors": self.write_errors}
        return out

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

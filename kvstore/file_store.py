"""Content-addressed block files under one directory: the host tier (on tmpfs) and the disk tier.

Why files: every stage process on a node can open them (prefill and decode run in
different processes under Ray), tmpfs keeps them in RAM, and the same code on a real
disk gives a prefix cache that survives restarts.

* One file per block, named by its hash, written to ``tmp/`` and renamed into place, so a
  reader sees a whole file or none.
* A shared SQLite index (``tier_index``: ``index.db``, WAL mode) holds each block's last access
  time, the block count and the pins. Its transactions serialize the capacity check and LRU
  choice across processes, so the capacity holds whoever writes. It is reconciled with the files
  at start, so it can never claim blocks that are gone or miss blocks that are there.
* Reads go straight to the file (no index round trip); a missing, corrupt, truncated or
  foreign file is a miss: the file is removed and counted, the caller recomputes.
* Pinned blocks (referenced by a running sequence somewhere) are never evicted. Pins carry
  their owner's pid; pins of dead processes are dropped at open.
* Evicted blocks go down the chain through ``demote``, which the chain's one owner (``LowerTiers``)
  wires (host -> disk), or are deleted (last tier).
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from strata.kvstore.block_file import BlockFileError, encode_block, read_header, read_layers_into
from strata.kvstore.block_files import BlockFiles, unlink
from strata.kvstore.index_writes import IndexWrites
from strata.kvstore.layout import KVLayout
from strata.kvstore.tier_index import TierIndex

_DEMOTE_BATCH = 16


class TierWriteError(OSError):
    """A tier could not store blocks (its filesystem or its index is full or read-only). Write-through
    is a cache: the caller keeps the block on the device or recomputes it later."""


Demote = Callable[[list[tuple[bytes, bytes]]], list[bool]]  # (hash, whole file) pairs -> which were stored


class FileBlockStore:
    """One tier of block files with an LRU capacity shared by every process that opens ``root``."""

    def __init__(
        self,
        root: str | Path,
        capacity_blocks: int,
        layout: KVLayout,
        fingerprint: bytes,
        name: str = "host",
        demote: "Demote | None" = None,
    ) -> None:
        """``demote``: where evicted blocks go (whole verified files; returns which were taken), wired by the
        chain's one owner, ``LowerTiers``; None: evicted blocks are deleted."""
        if capacity_blocks <= 0:
            raise ValueError(f"{name} tier capacity must be positive, got {capacity_blocks}")
        self.root = Path(root)
        self.capacity = capacity_blocks
        self.layout = layout
        self.fingerprint = fingerprint
        self.name = name
        self.demote = demote
        self.owner = f"{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.counters = {"hits": 0, "misses": 0, "corrupt": 0, "puts": 0, "rejected": 0, "evicted": 0, "demoted": 0,
                         "reconciled": 0, "write_failures": 0, "index_errors": 0}
        self.files = BlockFiles(self.root)
        self.index = TierIndex(self.root / "index.db", name)
        self.writes = IndexWrites(self.index, name, self.counters)
        self.rebuild_index()

    # ------------------------------------------------------------ index
    def rebuild_index(self) -> None:
        """Make the index agree with the files on disk; drop pins and temp files of dead processes."""
        self.files.sweep_dead_writers()
        with self.writes.lock, self.index.transaction():  # scan under the write lock: no put slips between scan and fix-up
            self.index.reconcile(self.files.scan())

    def __len__(self) -> int:
        with self.writes.lock:
            return self.index.count()

    # ------------------------------------------------------------ writes
    def put_many(self, items: Iterable[tuple[bytes, bytes | memoryview]], encoded: bool = False) -> list[bool]:
        """Store blocks (raw payloads, or whole files if ``encoded``); False where the tier is full of pins.

        Raises :class:`TierWriteError` when the tier's filesystem refuses a file or the index refuses a
        transaction (ENOSPC, ``database or disk is full``): nothing of the call is then left behind,
        files and index agree as before, and the caller treats the blocks as uncached."""
        def encode(block_hash: bytes, data: bytes | memoryview) -> bytes | memoryview:
            return data if encoded else encode_block(block_hash, self.fingerprint, self.layout, data)

        try:
            staged = self.files.stage(items, encode)
        except OSError as exc:  # a full or read-only tier: no temp file is left behind
            raise TierWriteError(f"{self.name} tier: {exc.strerror or exc}") from exc
        victims: list[tuple[bytes, str]] = []
        placed: list[str] = []
        try:
            with self.writes.transaction():
                results = self._place(staged, victims, placed)
        except (OSError, sqlite3.Error) as exc:
            self._undo(staged, victims, placed)
            raise TierWriteError(f"{self.name} tier: {exc}") from exc
        self._dispose(victims)
        return results

    def _place(self, staged: list[tuple[bytes, str]], victims: list[tuple[bytes, str]], placed: list[str]) -> list[bool]:
        """Inside the write transaction: make room (LRU, never a pinned block) and rename each staged file
        into place. ``victims`` and ``placed`` record every file move, so a failed commit can undo them."""
        results: list[bool] = []
        now = time.time()
        index = self.index
        count = index.count()
        for block_hash, tmp in staged:
            if index.has(block_hash):
                if os.path.exists(self.files.path(block_hash)):
                    index.touch([block_hash], now)
                    unlink(tmp)  # same content is already there
                    results.append(True)
                    continue
                # The index says present but the file is gone: believe the disk, store it again.
                index.delete(block_hash)
                count -= 1
                self.counters["reconciled"] += 1
            if count >= self.capacity:
                victim = index.oldest_unpinned()
                if victim is None:
                    unlink(tmp)
                    self.counters["rejected"] += 1
                    results.append(False)
                    continue
                index.delete(victim)
                moved = self.files.tmp_path()
                try:  # move it aside inside the transaction: a concurrent re-put cannot be unlinked by us
                    os.replace(self.files.path(victim), moved)
                    victims.append((victim, moved))
                except FileNotFoundError:
                    pass
                count -= 1
            final = self.files.path(block_hash)
            if os.path.exists(final):  # on disk but not indexed (a put whose commit failed): replace it
                unlink(final)
            os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
            os.replace(tmp, final)
            placed.append(final)
            index.insert(block_hash, now)
            count += 1
            self.counters["puts"] += 1
            results.append(True)
        index.set_count(count)
        return results

    def _undo(self, staged: list[tuple[bytes, str]], victims: list[tuple[bytes, str]], placed: list[str]) -> None:
        """The transaction rolled back: take the new files out again and put the evicted ones back, so the
        files agree with the index as it was before the call."""
        new = set(placed)
        for final in placed:
            unlink(final)
        for _, tmp in staged:
            unlink(tmp)
        for victim, moved in victims:
            if self.files.path(victim) in new:  # placed and evicted again within this call: it never existed
                unlink(moved)
                continue
            try:
                os.replace(moved, self.files.path(victim))
            except OSError:
                unlink(moved)  # cannot restore it: the index entry is reconciled on its next read
        self.counters["write_failures"] += 1

    def put(self, block_hash: bytes, payload: bytes | memoryview) -> bool:
        return self.put_many([(block_hash, payload)])[0]

    def _dispose(self, victims: list[tuple[bytes, str]]) -> None:
        """Demote evicted files down the chain (verified first, a few at a time so memory stays bounded),
        or delete them. A tier below that cannot take them (full disk) just loses them: they were evicted
        anyway, and a later reader recomputes."""
        batch: list[tuple[bytes, bytes]] = []
        for n, (block_hash, moved) in enumerate(victims, 1):
            self.counters["evicted"] += 1
            if self.demote is not None:
                blob = self._verified_file(block_hash, moved)
                if blob is not None:
                    batch.append((block_hash, blob))
            unlink(moved)
            if batch and (len(batch) == _DEMOTE_BATCH or n == len(victims)):
                assert self.demote is not None
                try:
                    self.counters["demoted"] += sum(self.demote(batch))
                except TierWriteError as exc:
                    self.writes.failed("demotion", exc)
                batch = []

    def _verified_file(self, block_hash: bytes, path: str) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            info = read_header(fd, block_hash, self.fingerprint, self.layout)
            buf = np.empty(info.slot_offsets[-1], dtype=np.uint8)
            read_layers_into(fd, info, buf, 0, self.layout.num_layers)
            return os.pread(fd, info.payload_offset, 0) + buf.tobytes()
        except BlockFileError:
            self.counters["corrupt"] += 1
            return None
        finally:
            os.close(fd)

    # ------------------------------------------------------------ reads
    def contains(self, block_hash: bytes) -> bool:
        return os.path.exists(self.files.path(block_hash))

    def read_layers(self, block_hash: bytes, out: np.ndarray, first_layer: int = 0, num_layers: int | None = None) -> bool:
        """Fill ``out`` (uint8, exact size) with slots of a block (layers in block order, ``KVLayout.slot_of``);
        False on a miss (bad files are removed)."""
        n = self.layout.num_layers - first_layer if num_layers is None else num_layers
        path = self.files.path(block_hash)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self.counters["misses"] += 1
            self._forget(block_hash)  # an index entry whose file vanished: reconcile
            return False
        try:
            info = read_header(fd, block_hash, self.fingerprint, self.layout)
            read_layers_into(fd, info, out, first_layer, n)
        except BlockFileError:
            self.counters["corrupt"] += 1
            self.remove(block_hash)
            return False
        finally:
            os.close(fd)
        self.counters["hits"] += 1
        return True

    def read_encoded(self, block_hash: bytes) -> bytes | None:
        """The whole verified file (for promotion into an upper tier), or None."""
        blob = self._verified_file(block_hash, self.files.path(block_hash))
        if blob is None and self.contains(block_hash):
            self.remove(block_hash)
        return blob

    def touch(self, hashes: Iterable[bytes]) -> None:
        """Mark blocks as just used (LRU). If the index cannot take it, the LRU order is only staler."""
        now = time.time()
        hashes = list(hashes)
        self.writes.run("touch", lambda: self.index.touch(hashes, now))

    def remove(self, block_hash: bytes) -> None:
        self.writes.run("remove", lambda: self.index.remove(block_hash))
        unlink(self.files.path(block_hash))  # a bad file goes even when the index cannot say so (it is reconciled)

    def _forget(self, block_hash: bytes) -> None:
        """Drop the index entry of a block whose file is missing (unless someone just wrote it)."""
        def drop() -> None:
            if not os.path.exists(self.files.path(block_hash)) and self.index.remove(block_hash):
                self.counters["reconciled"] += 1

        self.writes.run("reconcile", drop)

    # ------------------------------------------------------------ pins
    def pin(self, hashes: Iterable[bytes], owner: str | None = None) -> None:
        """Keep blocks from eviction. If the index cannot record it the block may be evicted while read,
        which its reader sees as a lost block and recomputes: costlier, never wrong."""
        rows = [(h, owner or self.owner) for h in hashes]
        self.writes.run("pin", lambda: self.index.add_pins(rows))

    def unpin(self, hashes: Iterable[bytes], owner: str | None = None) -> None:
        """Release pins. One the index cannot drop now is retried with every later index write, so a
        full filesystem never leaves blocks pinned for good."""
        self.writes.owe_unpins((h, owner or self.owner) for h in hashes)
        self.writes.run("unpin", lambda: None)

    def num_pinned(self) -> int:
        with self.writes.lock:
            return self.index.num_pinned()

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self), "capacity": self.capacity, **self.counters}

    def close(self) -> None:
        self.writes.run("close", lambda: self.index.delete_owner(self.owner))
        self.index.close()  # pins this left behind (a full index) belong to a dead pid: dropped at the next open

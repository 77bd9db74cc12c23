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

import logging
import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from strata.kvstore.block_file import BlockFileError, encode_block, read_header, read_layers_into
from strata.kvstore.layout import KVLayout
from strata.kvstore.liveness import pid_alive
from strata.kvstore.private_dir import private_dir
from strata.kvstore.tier_index import TierIndex

_DEMOTE_BATCH = 16


log = logging.getLogger(__name__)


class TierWriteError(OSError):
    """A tier could not store blocks (its filesystem or its index is full or read-only). Write-through
    is a cache: the caller keeps the block on the device or recomputes it later."""


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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
        self._lock = threading.Lock()
        self._unpins: list[tuple[bytes, str]] = []  # pins to drop that the index could not take yet
        self._blocks_dir = str(self.root / "blocks")
        self._tmp_dir = str(self.root / "tmp")
        private_dir(self.root)
        private_dir(Path(self._blocks_dir))
        private_dir(Path(self._tmp_dir))
        self.index = TierIndex(self.root / "index.db", name)
        self.rebuild_index()

    # ------------------------------------------------------------ paths
    def path(self, block_hash: bytes) -> str:
        # Plain strings, not pathlib: pathlib interns every component, which grows with the blocks seen.
        h = block_hash.hex()
        return os.path.join(self._blocks_dir, h[:2], h + ".kv")

    def _tmp_path(self) -> str:
        return os.path.join(self._tmp_dir, f"{os.getpid()}.{uuid.uuid4().hex}")

    # ------------------------------------------------------------ index
    def rebuild_index(self) -> None:
        """Make the index agree with the files on disk; drop pins and temp files of dead processes."""
        for entry in os.scandir(self.root / "tmp"):
            pid = entry.name.split(".", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                _unlink(entry.path)
        with self._lock, self.index.transaction():  # scan under the write lock: no put slips between scan and fix-up
            self.index.reconcile(self._scan_files())

    def _scan_files(self) -> dict[bytes, float]:
        present: dict[bytes, float] = {}
        for sub in (self.root / "blocks").iterdir():
            for entry in os.scandir(sub):
                if entry.name.endswith(".kv"):
                    try:
                        present[bytes.fromhex(entry.name[:-3])] = entry.stat().st_mtime
                    except (ValueError, FileNotFoundError):
                        continue
        return present

    def __len__(self) -> int:
        with self._lock:
            return self.index.count()

    # ------------------------------------------------------------ writes
    def put_many(self, items: Iterable[tuple[bytes, bytes | memoryview]], encoded: bool = False) -> list[bool]:
        """Store blocks (raw payloads, or whole files if ``encoded``); False where the tier is full of pins.

        Raises :class:`TierWriteError` when the tier's filesystem refuses a file or the index refuses a
        transaction (ENOSPC, ``database or disk is full``): nothing of the call is then left behind,
        files and index agree as before, and the caller treats the blocks as uncached."""
        staged: list[tuple[bytes, str]] = []
        try:
            for block_hash, data in items:
                tmp = self._tmp_path()
                staged.append((block_hash, tmp))
                blob = data if encoded else encode_block(block_hash, self.fingerprint, self.layout, data)
                with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(blob)
        except OSError as exc:  # a full or read-only tier: leave no temp files behind
            for _, tmp in staged:
                _unlink(tmp)
            raise TierWriteError(f"{self.name} tier: {exc.strerror or exc}") from exc
        victims: list[tuple[bytes, str]] = []
        placed: list[str] = []
        try:
            with self._lock:
                with self.index.transaction():
                    self._flush_unpins()
                    results = self._place(staged, victims, placed)
                self._unpins.clear()
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
                if os.path.exists(self.path(block_hash)):
                    index.touch([block_hash], now)
                    _unlink(tmp)  # same content is already there
                    results.append(True)
                    continue
                # The index says present but the file is gone: believe the disk, store it again.
                index.delete(block_hash)
                count -= 1
                self.counters["reconciled"] += 1
            if count >= self.capacity:
                victim = index.oldest_unpinned()
                if victim is None:
                    _unlink(tmp)
                    self.counters["rejected"] += 1
                    results.append(False)
                    continue
                index.delete(victim)
                moved = self._tmp_path()
                try:  # move it aside inside the transaction: a concurrent re-put cannot be unlinked by us
                    os.replace(self.path(victim), moved)
                    victims.append((victim, moved))
                except FileNotFoundError:
                    pass
                count -= 1
            final = self.path(block_hash)
            if os.path.exists(final):  # on disk but not indexed (a put whose commit failed): replace it
                _unlink(final)
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
            _unlink(final)
        for _, tmp in staged:
            _unlink(tmp)
        for victim, moved in victims:
            if self.path(victim) in new:  # placed and evicted again within this call: it never existed
                _unlink(moved)
                continue
            try:
                os.replace(moved, self.path(victim))
            except OSError:
                _unlink(moved)  # cannot restore it: the index entry is reconciled on its next read
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
            _unlink(moved)
            if batch and (len(batch) == _DEMOTE_BATCH or n == len(victims)):
                assert self.demote is not None
                try:
                    self.counters["demoted"] += sum(self.demote(batch))
                except TierWriteError as exc:
                    self._index_failed("demotion", exc)
                batch = []

    def _verified_file(self, block_hash: bytes, path: str) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            info = read_header(fd, block_hash, self.fingerprint, self.layout)
            buf = np.empty(info.layer_bytes * self.layout.num_layers, dtype=np.uint8)
            read_layers_into(fd, info, buf, 0, self.layout.num_layers)
            return os.pread(fd, info.payload_offset, 0) + buf.tobytes()
        except BlockFileError:
            self.counters["corrupt"] += 1
            return None
        finally:
            os.close(fd)

    # ------------------------------------------------------------ reads
    def contains(self, block_hash: bytes) -> bool:
        return os.path.exists(self.path(block_hash))

    def read_layers(self, block_hash: bytes, out: np.ndarray, first_layer: int = 0, num_layers: int | None = None) -> bool:
        """Fill ``out`` (uint8, exact size) with layers of a block; False on a miss (bad files are removed)."""
        n = self.layout.num_layers - first_layer if num_layers is None else num_layers
        path = self.path(block_hash)
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
        blob = self._verified_file(block_hash, self.path(block_hash))
        if blob is None and self.contains(block_hash):
            self.remove(block_hash)
        return blob

    def touch(self, hashes: Iterable[bytes]) -> None:
        """Mark blocks as just used (LRU). If the index cannot take it, the LRU order is only staler."""
        now = time.time()
        hashes = list(hashes)
        self._write_index("touch", lambda: self.index.touch(hashes, now))

    def remove(self, block_hash: bytes) -> None:
        self._write_index("remove", lambda: self.index.remove(block_hash))
        _unlink(self.path(block_hash))  # a bad file goes even when the index cannot say so (it is reconciled)

    def _forget(self, block_hash: bytes) -> None:
        """Drop the index entry of a block whose file is missing (unless someone just wrote it)."""
        def drop() -> None:
            if not os.path.exists(self.path(block_hash)) and self.index.remove(block_hash):
                self.counters["reconciled"] += 1

        self._write_index("reconcile", drop)

    # ------------------------------------------------------------ pins
    def pin(self, hashes: Iterable[bytes], owner: str | None = None) -> None:
        """Keep blocks from eviction. If the index cannot record it the block may be evicted while read,
        which its reader sees as a lost block and recomputes: costlier, never wrong."""
        rows = [(h, owner or self.owner) for h in hashes]
        self._write_index("pin", lambda: self.index.add_pins(rows))

    def unpin(self, hashes: Iterable[bytes], owner: str | None = None) -> None:
        """Release pins. One the index cannot drop now is retried with every later index write, so a
        full filesystem never leaves blocks pinned for good."""
        with self._lock:
            self._unpins.extend((h, owner or self.owner) for h in hashes)
        self._write_index("unpin", lambda: None)

    def _write_index(self, what: str, change: Callable[[], object]) -> bool:
        """Run ``change`` in a write transaction (with any pending unpins); False if the index refused it."""
        with self._lock:
            try:
                with self.index.transaction():
                    self._flush_unpins()
                    change()
                self._unpins.clear()
                return True
            except sqlite3.Error as exc:
                self._index_failed(what, exc)
                return False

    def _flush_unpins(self) -> None:
        """Inside a write transaction (lock held): drop the pins earlier writes could not."""
        if self._unpins:
            self.index.delete_pins(self._unpins)

    def _index_failed(self, what: str, exc: Exception) -> None:
        self.counters["index_errors"] += 1
        n = self.counters["index_errors"]
        if n == 1 or n % 1000 == 0:
            log.warning("KV %s tier: %s failed (%s); caching degrades, requests go on (%d failures so far)",
                        self.name, what, exc, n)

    def num_pinned(self) -> int:
        with self._lock:
            return self.index.num_pinned()

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self), "capacity": self.capacity, **self.counters}

    def close(self) -> None:
        self._write_index("close", lambda: self.index.delete_owner(self.owner))
        self.index.close()  # pins this left behind (a full index) belong to a dead pid: dropped at the next open

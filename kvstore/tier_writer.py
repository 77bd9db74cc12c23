"""Write-behind for the lower tiers: block files and index transactions leave the step thread.

Publishing a block writes it through to the host tier (a file, a SQLite transaction, and the
demotion of whatever that evicts to disk). Done inline, that I/O sits between two forwards. Here
the step thread only copies the block's bytes into a bounded queue; one writer thread drains it in
batches (one index transaction per batch).

The rules that keep this a cache and never a source of wrong answers:

* a block is reusable from a tier only once its write has landed: lookups go to the files, and a
  queued block is not in them yet;
* the queue holds copies, so a device block reused after its publication cannot change what lands;
* a full queue drops the *caching* of a block (counted), never a token: a block that must leave the
  device later (a spill) is written on the spot if it is not below yet (:meth:`take`);
* a hand-off to another pool waits for its blocks (:meth:`wait_for`), and the interpreter drains every
  writer at exit, so a prefix a process computed reaches the next one.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

log = logging.getLogger(__name__)

Store = Callable[[list[tuple[bytes, bytes]], bool], list[bool]]  # (items, encoded) -> stored per item
BATCH_BLOCKS = 32  # blocks per index transaction
_WRITERS: "weakref.WeakSet[TierWriter]" = weakref.WeakSet()


class TierWriter:
    """One daemon thread writing queued blocks through ``store``; at most ``max_blocks`` queued."""

    def __init__(self, store: Store, max_blocks: int, name: str = "kv-tier-writer") -> None:
        if max_blocks < 1:
            raise ValueError("a tier writer needs room for at least one block")
        self.store = store
        self.max_blocks = max_blocks
        self.counters = {"queued": 0, "written": 0, "dropped": 0, "failed": 0}
        self._queued: OrderedDict[bytes, tuple[bytes, bool]] = OrderedDict()  # hash -> (payload, encoded)
        self._in_flight: set[bytes] = set()  # taken by the thread, not landed yet
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _WRITERS.add(self)

    # ------------------------------------------------------------ the step thread's side
    def submit(self, items: Iterable[tuple[bytes, bytes | memoryview]], encoded: bool = False) -> int:
        """Queue copies of ``items``; returns how many were dropped because the queue was full."""
        dropped = 0
        with self._cond:
            for block_hash, data in items:
                if block_hash in self._queued or block_hash in self._in_flight:
                    continue
                if self._closed or len(self._queued) + len(self._in_flight) >= self.max_blocks:
                    dropped += 1
                    continue
                self._queued[block_hash] = (bytes(data), encoded)
                self.counters["queued"] += 1
            self.counters["dropped"] += dropped
            self._cond.notify_all()
        return dropped

    def pending(self, block_hash: bytes) -> bool:
        with self._cond:
            return block_hash in self._queued or block_hash in self._in_flight

    def take(self, block_hash: bytes) -> tuple[bytes, bool] | None:
        """Withdraw a queued block for the caller to write now (a spill cannot wait its turn). Waits
        while the thread is writing it; None when it is not queued (landed, dropped, or never sent)."""
        with self._cond:
            self._cond.wait_for(lambda: block_hash not in self._in_flight)
            return self._queued.pop(block_hash, None)

    def wait_for(self, hashes: Sequence[bytes], timeout: float | None = None) -> bool:
        """Block until none of ``hashes`` is queued or being written; False on timeout."""
        wanted = set(hashes)
        with self._cond:
            return self._cond.wait_for(lambda: wanted.isdisjoint(self._queued) and wanted.isdisjoint(self._in_flight),
                                       timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Block until everything queued has landed (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued and not self._in_flight, timeout)

    def depth(self) -> int:
        with self._cond:
            return len(self._queued) + len(self._in_flight)

    def close(self, timeout: float = 60.0) -> None:
        """Drain the queue, then stop the thread. Idempotent."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # ------------------------------------------------------------ the writer thread
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued or self._closed)
                if not self._queued:
                    return  # closed and drained
                batch = [self._queued.popitem(last=False) for _ in range(min(BATCH_BLOCKS, len(self._queued)))]
                self._in_flight.update(h for h, _ in batch)
            written = failed = 0
            for encoded in (False, True):
                items = [(h, data) for h, (data, enc) in batch if enc is encoded]
                if not items:
                    continue
                try:
                    stored = self.store(items, encoded)
                    written += sum(stored)
                    failed += len(stored) - sum(stored)
                except Exception:  # a cache write must never take the writer down with it
                    log.exception("KV tier write-behind failed for %d blocks", len(items))
                    failed += len(items)
            with self._cond:
                self._in_flight.difference_update(h for h, _ in batch)
                self.counters["written"] += written
                self.counters["failed"] += failed
                self._cond.notify_all()


@atexit.register
def _drain_at_exit() -> None:
    """Blocks a process computed reach its tiers even when nobody closed the engine (a script's end)."""
    for writer in list(_WRITERS):
        writer.flush(timeout=60.0)

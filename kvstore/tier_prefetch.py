"""Read-ahead for prefix hits in the lower tiers: the files are read while the step before runs.

When a waiting request's prompt starts with blocks the host or disk tier holds, admitting it copies
them back to the device, and each copy first reads a file. The scheduler names those blocks one step
early (:meth:`TierPrefetcher.request`); this thread reads them into a bounded cache while the model
computes, and the admission finds them in memory (:meth:`TierPrefetcher.take`). A block is
content-addressed, so what was read cannot go stale; a read that fails or was not done in time only
means the admission reads the file itself, as it would have.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

Read = Callable[[bytes, np.ndarray], bool]  # (block hash, out uint8 array) -> found


class TierPrefetcher:
    """One daemon thread reading requested blocks into at most ``max_blocks`` buffers."""

    def __init__(self, read: Read, block_nbytes: int, max_blocks: int, name: str = "kv-prefetch") -> None:
        if max_blocks < 1:
            raise ValueError("a prefetcher needs room for at least one block")
        self.read = read
        self.block_nbytes = block_nbytes
        self.max_blocks = max_blocks
        self.counters = {"requested": 0, "read": 0, "used": 0, "missed": 0, "evicted": 0}
        self._wanted: OrderedDict[bytes, None] = OrderedDict()
        self._ready: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def request(self, hashes: Sequence[bytes]) -> None:
        """Read these blocks ahead (those not already read or queued), oldest requests first."""
        with self._cond:
            for h in hashes:
                if h not in self._ready and h not in self._wanted and len(self._wanted) < self.max_blocks:
                    self._wanted[h] = None
                    self.counters["requested"] += 1
            self._cond.notify_all()

    def take(self, block_hash: bytes, out: np.ndarray) -> bool:
        """Copy a block read ahead into ``out`` and forget it; False if it was not read (yet)."""
        with self._cond:
            data = self._ready.pop(block_hash, None)
        if data is None:
            return False
        out.reshape(-1)[:] = data
        self.counters["used"] += 1
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every requested block was read (tests)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._wanted, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._wanted.clear()
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._wanted or self._closed)
                if self._closed:
                    return
                block_hash = next(iter(self._wanted))
            buf = np.empty(self.block_nbytes, dtype=np.uint8)
            try:
                found = self.read(block_hash, buf)
            except Exception:  # read-ahead is an optimisation: the admission reads it again if it must
                log.exception("KV prefetch of a block failed")
                found = False
            with self._cond:
                self._wanted.pop(block_hash, None)
                if found:
                    self._ready[block_hash] = buf
                    self.counters["read"] += 1
                    while len(self._ready) > self.max_blocks:  # the oldest read-ahead was never used
                        self._ready.popitem(last=False)
                        self.counters["evicted"] += 1
                else:
                    self.counters["missed"] += 1
                self._cond.notify_all()

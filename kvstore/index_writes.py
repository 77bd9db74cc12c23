"""One process's writes to a tier's shared index (``tier_index``).

Writes are serialized by a lock and each runs in one SQLite transaction. A write the index refuses (a
full or read-only filesystem) is counted and logged, and the tier goes on as a worse cache; an unpin it
refused is owed, and paid with the next write that succeeds, so a full disk never pins blocks for good.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from strata.kvstore.tier_index import TierIndex

log = logging.getLogger(__name__)


class IndexWrites:
    """The lock, the transactions and the owed unpins of one tier's index in this process."""

    def __init__(self, index: TierIndex, tier: str, counters: dict[str, int]) -> None:
        self.index = index
        self.tier = tier
        self.counters = counters  # the tier's counters: index_errors is counted here
        self.lock = threading.Lock()
        self.owed_unpins: list[tuple[bytes, str]] = []

    @contextmanager
    def transaction(self) -> Iterator[TierIndex]:
        """The lock held and a write transaction open, owed unpins paid first; an error rolls back and
        propagates (the debt stays)."""
        with self.lock:
            with self.index.transaction():
                if self.owed_unpins:
                    self.index.delete_pins(self.owed_unpins)
                yield self.index
            self.owed_unpins.clear()

    def run(self, what: str, change: Callable[[], object]) -> bool:
        """Run ``change`` in a write transaction; False (counted, logged) if the index refused it."""
        try:
            with self.transaction():
                change()
            return True
        except sqlite3.Error as exc:
            self.failed(what, exc)
            return False

    def owe_unpins(self, rows: Iterable[tuple[bytes, str]]) -> None:
        """Pins to drop with the next write that succeeds."""
        with self.lock:
            self.owed_unpins.extend(rows)

    def failed(self, what: str, exc: Exception) -> None:
        self.counters["index_errors"] += 1
        n = self.counters["index_errors"]
        if n == 1 or n % 1000 == 0:
            log.warning("KV %s tier: %s failed (%s); caching degrades, requests go on (%d failures so far)",
                        self.tier, what, exc, n)

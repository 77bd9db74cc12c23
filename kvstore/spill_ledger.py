"""Which spilled blocks this process reads, and how many are spilled now.

A spilled block lives only in a lower tier, so no tier may evict it while a sequence reads it. The
tiers' pins are shared by every process on the node (``FileBlockStore.pin``); this ledger counts the
readers inside one process, so the shared pin is taken by the first and dropped by the last.
"""

from __future__ import annotations

from typing import Sequence

from strata.kvstore.lower_tiers import LowerTiers


class SpillLedger:
    """Reader counts per spilled block (the tiers' pins follow them) and the spilled-blocks gauge."""

    def __init__(self, lower: LowerTiers | None) -> None:
        self.lower = lower
        self._readers: dict[bytes, int] = {}
        self.current = 0  # blocks spilled by live tables now
        self.peak = 0

    def pin(self, hashes: Sequence[bytes]) -> None:
        """One more reader of each block; the shared pin is taken for blocks that had none."""
        first = [h for h in hashes if self._readers.get(h, 0) == 0]
        for h in hashes:
            self._readers[h] = self._readers.get(h, 0) + 1
        if self.lower is not None:
            self.lower.pin(first)

    def unpin(self, hashes: Sequence[bytes]) -> None:
        """One reader fewer of each block; the shared pin goes with the last."""
        last = []
        for h in hashes:
            n = self._readers[h] - 1
            if n:
                self._readers[h] = n
            else:
                del self._readers[h]
                last.append(h)
        if self.lower is not None:
            self.lower.unpin(last)

    def count(self, n: int) -> None:
        """``n`` blocks spilled (negative: released)."""
        self.current += n
        self.peak = max(self.peak, self.current)

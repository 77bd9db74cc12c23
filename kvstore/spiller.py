"""Making room on the device by spilling: a live table's oldest published blocks leave the device and
stay pinned in a lower tier, from where attention streams them back (``spilled_reads``)."""

from __future__ import annotations

from typing import Iterable

from strata.kvstore.block_copies import BlockCopies
from strata.kvstore.block_pool import BlockPool
from strata.kvstore.block_table import BlockTable
from strata.kvstore.spill_ledger import SpillLedger


class Spiller:
    """Chooses whose blocks leave the device, and moves them."""

    def __init__(self, pool: BlockPool, copies: BlockCopies, spills: SpillLedger) -> None:
        self.pool = pool
        self.copies = copies
        self.spills = spills

    def make_room(self, blocks: int, candidates: Iterable[BlockTable]) -> bool:
        """Spill until ``blocks`` device blocks are free, each time from the candidate whose spill frees the
        most (a block other tables share frees nothing, so a shared prefix is not streamed for no gain).
        False if that is not enough (what was spilled stays spilled: it is still correct)."""
        tables = list(candidates)
        while self.pool.num_free() < blocks:
            if self.copies.lower is None:
                return False
            want = blocks - self.pool.num_free()
            plans = [(self.plan(t, want), t) for t in tables]
            (count, freed), best = max(plans, key=lambda p: p[0][1], default=((0, 0), None))
            if best is None or freed == 0 or self.spill(best, count) == 0:
                return False
        return True

    def plan(self, table: BlockTable, want: int) -> tuple[int, int]:
        """(blocks to spill, device blocks that frees): the shortest leading run of resident
        published blocks that frees ``want`` blocks, or all of them."""
        count = freed = 0
        for block_id in table.block_ids[: self._spillable(table) - table.num_spilled]:
            count += 1
            freed += self.pool.ref_count(block_id) == 1
            if freed >= want:
                break
        return count, freed

    def spill(self, table: BlockTable, n: int) -> int:
        """Drop the ``n`` oldest resident published blocks from the device; returns how many left."""
        done = 0
        while done < n and table.num_spilled < self._spillable(table) and table.block_ids:
            h = table.hashes[table.num_spilled]
            if not self.copies.ensure_below(h):
                break
            self.spills.pin([h])
            self.pool.free(table.block_ids.pop(0))
            table.num_spilled += 1
            done += 1
        self.spills.count(done)
        return done

    @staticmethod
    def _spillable(table: BlockTable) -> int:
        """Blocks that may leave: published ones every sliding window has passed (a windowed layer
        reads only from the device, ``window_claims``)."""
        return min(table.num_published, table.window_floor())

"""A table's claims on its sliding-window groups: taken with each new block, given up as the window moves
past a block, and checked when a cached prefix is adopted.

A windowed group reads, for a sequence of ``n`` tokens, only logical blocks from
``WindowSlots.first_block(n)`` on; ``BlockTable.window_starts`` records where that is. Blocks before it keep
their place in the table (full-attention groups still read them) but no longer hold this group's slot,
so a long sequence holds a fixed number of windowed slots however long it grows. A published block's
part stays on the device, idle, until a new claim needs its slot, so the next turn of a chat finds it.

A prefix is adopted only where the window at its end is whole on the device: a block whose windowed part
was reclaimed ends the match (its tokens are computed again), so a windowed layer never reads a part that
is gone. Such a layer never reads a spilled block either: the spiller moves only blocks before every
window (``BlockTable.window_floor``), and the prefix matcher leaves spilled only blocks before the windows
at the end of the prefix it adopts (``floor_at``).
"""

from __future__ import annotations

from strata.kvstore.block_pool import BlockPool
from strata.kvstore.block_table import BlockTable
from strata.kvstore.window_slots import WindowSlots


class WindowClaims:
    """Claims of tables on the pool's windowed groups (a no-op for a model with none)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.windows = pool.windows

    def room(self, blocks: int) -> bool:
        """Whether every windowed group can lend ``blocks`` more slots."""
        return all(w.num_available() >= blocks for w in self.windows.values())

    def claim_new(self, table: BlockTable, block_id: int) -> None:
        """``block_id`` was just appended to ``table`` (fresh, about to be written): every group claims it."""
        for gi, w in self.windows.items():
            table.window_starts.setdefault(gi, table.num_spilled)
            w.claim_new(block_id)

    def slide(self, table: BlockTable) -> None:
        """The table now holds ``num_tokens``: give up the blocks every later query's window has passed."""
        for gi, w in self.windows.items():
            start = table.window_starts.get(gi, table.num_spilled)
            new = min(w.first_block(table.num_tokens, table.block_size), table.num_blocks)
            for j in range(max(start, table.num_spilled), new):
                self._release(w, table.block_ids[j - table.num_spilled])
            table.window_starts[gi] = max(start, new)

    def release_all(self, table: BlockTable) -> None:
        """Before the table's blocks are freed: every claim it holds goes."""
        for gi, w in self.windows.items():
            start = table.window_starts.get(gi, table.num_spilled)
            for block_id in table.block_ids[max(start, table.num_spilled) - table.num_spilled :]:
                self._release(w, block_id)
        table.window_starts.clear()

    def adopt(self, table: BlockTable) -> None:
        """A table rebuilt from a same-pool handle takes over its holder's claims, which start where the
        holder's window did."""
        for gi, w in self.windows.items():
            table.window_starts[gi] = max(table.num_spilled, w.first_block(table.num_tokens, table.block_size))

    def floor_at(self, num_blocks: int, block_size: int) -> int:
        """The first block any window reads at the end of a ``num_blocks``-block prefix: the blocks before it
        may stay spilled when the prefix is adopted."""
        return min((w.first_block(num_blocks * block_size, block_size) for w in self.windows.values()),
                   default=num_blocks)

    def fit_match(self, table: BlockTable, num_blocks: int) -> int:
        """The longest match of at most ``num_blocks`` leading blocks whose window is whole on the device in
        every group (-1: none that keeps the table's spilled blocks outside every window); the resident
        blocks beyond it are the caller's to let go."""
        bs, k, skip = table.block_size, num_blocks, table.num_spilled
        while k > skip:
            if self.floor_at(k, bs) < skip:
                return -1
            missing = [j for w in self.windows.values() for j in range(w.first_block(k * bs, bs), k)
                       if not w.has(table.block_ids[j - skip])]
            if not missing:
                return k
            k = min(missing)  # the match ends before the first block whose part is gone
        return k if k == 0 else -1

    def claim_match(self, table: BlockTable, num_blocks: int) -> None:
        """Claim the window at the end of an adopted ``num_blocks``-block prefix (``fit_match`` held)."""
        for gi, w in self.windows.items():
            start = w.first_block(num_blocks * table.block_size, table.block_size)
            for j in range(start, num_blocks):
                if not w.claim(table.block_ids[j - table.num_spilled]):
                    raise AssertionError("claim_match after a fit_match that did not hold")
            table.window_starts[gi] = start

    def _release(self, w: WindowSlots, block_id: int) -> None:
        w.release(block_id, keep=self.pool.block_hash(block_id) is not None)

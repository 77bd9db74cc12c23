"""Device storage of a sliding-window cache group: fewer slots than the pool has blocks, lent per block.

A sliding-window layer never reads a key older than its window, so a sequence needs that group's KV only
for its last ``window`` tokens (plus the chunk it is computing). The pool's block ids stay the unit of
accounting, hashing and hand-off; a windowed group holds its part of a block in a *slot* of its own,
smaller tensor, from the moment the block is allocated until no table holds the block inside its window.

Per block id, this group's part is in one of three states:

* absent  - ``slot[b] == -1``: not on the device (never written here, or its slot was reclaimed);
* claimed - a slot and ``claims[b] > 0`` tables hold ``b`` inside their window; never reclaimed;
* idle    - a slot and no claim; kept, in LRU order, so a prefix hit can still use it, and reclaimed
            by the next slot allocation that finds no free slot.

The pool calls :meth:`drop` when block ``b`` itself leaves the device, so a reused id never inherits an
old slot. Not thread-safe: owned, like the pool, by one scheduler loop.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from strata.kvstore.layout import KVLayout


def window_slot_counts(layout: KVLayout, num_blocks: int, max_seqs: int, max_batched_tokens: int) -> dict[int, int]:
    """Device slots each sliding-window group needs so that its slots never stop a step the pool could run.

    A running sequence whose next chunk is ``c`` tokens from position ``n`` claims the blocks that hold
    positions ``n - window + 1 .. n + c - 1``: at most ``cdiv(window - 1 + c, block_size) + 1`` of them. Over
    ``max_seqs`` sequences whose chunks sum to at most ``max_batched_tokens``, that is below
    ``max_seqs * (cdiv(window - 1, block_size) + 3) + cdiv(max_batched_tokens, block_size)``. Never more
    than the pool's blocks (a group with as many slots as blocks never runs out)."""
    return {gi: min(num_blocks, slots_for_window(layout.groups[gi].window, layout.block_size, max_seqs,  # type: ignore[arg-type]
                                                 max_batched_tokens)) for gi in layout.window_groups}


def slots_for_window(window: int, block_size: int, max_seqs: int, max_batched_tokens: int) -> int:
    """The bound of :func:`window_slot_counts` for one window (the planner sizes a model's windows with it)."""
    return max_seqs * (-(-(window - 1) // block_size) + 3) + -(-max_batched_tokens // block_size)


class NoFreeSlotsError(RuntimeError):
    """Every slot of a windowed group is claimed."""


class WindowSlots:
    """Slot lending for one windowed cache group (see the module docstring)."""

    def __init__(self, num_slots: int, num_blocks: int, window: int) -> None:
        if num_slots <= 0 or num_blocks <= 0 or window <= 0:
            raise ValueError("slots, blocks and the window must be positive")
        self.num_slots = num_slots
        self.window = window
        self.slot: list[int] = [-1] * num_blocks
        self.claims: list[int] = [0] * num_blocks
        self._free: deque[int] = deque(range(num_slots))
        self._idle: OrderedDict[int, None] = OrderedDict()  # block ids, least recently released first
        self.num_reclaimed = 0  # idle parts dropped to make room (monotonic)
        self.peak_claimed = 0

    # ------------------------------------------------------------ queries
    def has(self, block_id: int) -> bool:
        """Whether this group's part of ``block_id`` is on the device."""
        return self.slot[block_id] >= 0

    def num_available(self) -> int:
        """Slots a new claim can take now (free, or idle and reclaimable)."""
        return len(self._free) + len(self._idle)

    def num_claimed(self) -> int:
        return self.num_slots - len(self._free) - len(self._idle)

    def first_block(self, num_tokens: int, block_size: int) -> int:
        """The first logical block a sequence of ``num_tokens`` tokens still reads in this group: its next
        query (position ``num_tokens``) sees keys from ``num_tokens - window + 1`` on."""
        return max(0, num_tokens - self.window + 1) // block_size

    # ------------------------------------------------------------ transitions
    def claim_new(self, block_id: int) -> None:
        """A slot for a freshly allocated block whose KV is about to be written (one claim)."""
        if self.slot[block_id] >= 0:
            raise ValueError(f"block {block_id} already has a slot")
        self.slot[block_id] = self._take()
        self.claims[block_id] = 1
        self._note_peak()

    def lend(self, block_id: int) -> bool:
        """An idle slot for a block promoted from a tier (its part is then written); False if none."""
        if self.slot[block_id] >= 0:
            return True
        try:
            self.slot[block_id] = self._take()
        except NoFreeSlotsError:
            return False
        self._idle[block_id] = None
        return True

    def claim(self, block_id: int) -> bool:
        """One more table holds ``block_id`` in its window; False (nothing changed) if its part is absent."""
        if self.slot[block_id] < 0:
            return False
        if self.claims[block_id] == 0:
            del self._idle[block_id]
        self.claims[block_id] += 1
        self._note_peak()
        return True

    def release(self, block_id: int, keep: bool) -> None:
        """A table no longer reads ``block_id`` here. At the last claim the part stays idle if ``keep`` (a
        published block: a prefix hit may want it) or its slot is freed at once."""
        if self.claims[block_id] <= 0:
            raise ValueError(f"block {block_id} holds no claim in this group")
        self.claims[block_id] -= 1
        if self.claims[block_id] == 0:
            if keep:
                self._idle[block_id] = None
            else:
                self._free_slot(block_id)

    def transfer(self, src: int, dst: int) -> None:
        """``dst`` holds the same tokens as ``src`` (same hash) and replaces it in a table: the table's claim
        moves to ``dst``, and ``src``'s part moves with it when ``dst`` has none on the device."""
        if self.claims[src] == 0:
            return
        if self.claim(dst):
            self.release(src, keep=False)
            return
        self.slot[dst], self.claims[dst] = self.slot[src], self.claims[src]
        self.slot[src], self.claims[src] = -1, 0

    def drop(self, block_id: int) -> None:
        """Block ``block_id`` left the device (freed or evicted): its part goes with it."""
        if self.claims[block_id]:
            raise ValueError(f"block {block_id} left the device while a table still reads it")
        if self.slot[block_id] >= 0:
            self._idle.pop(block_id, None)
            self._free_slot(block_id)

    # ------------------------------------------------------------ internals
    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        if not self._idle:
            raise NoFreeSlotsError(f"all {self.num_slots} slots of the {self.window}-token window are claimed")
        victim, _ = self._idle.popitem(last=False)
        slot, self.slot[victim] = self.slot[victim], -1
        self.num_reclaimed += 1
        return slot

    def _free_slot(self, block_id: int) -> None:
        self._free.append(self.slot[block_id])
        self.slot[block_id] = -1

    def _note_peak(self) -> None:
        self.peak_claimed = max(self.peak_claimed, self.num_claimed())

    def stats(self) -> dict[str, int]:
        return {"window": self.window, "slots": self.num_slots, "claimed": self.num_claimed(),
                "idle": len(self._idle), "free": len(self._free), "reclaimed": self.num_reclaimed,
                "peak_claimed": self.peak_claimed}

    def check_invariants(self) -> None:
        """O(blocks) consistency check, for tests and debugging."""
        held = [s for s in self.slot if s >= 0]
        assert len(set(held)) == len(held), "a slot lent to two blocks"
        assert not set(held) & set(self._free), "a lent slot is also free"
        assert len(held) + len(self._free) == self.num_slots, "slots lost or duplicated"
        for b, (s, c) in enumerate(zip(self.slot, self.claims)):
            assert c >= 0
            if c > 0:
                assert s >= 0 and b not in self._idle, f"claimed block {b} without a slot, or idle"
            elif s >= 0:
                assert b in self._idle, f"unclaimed block {b} keeps a slot outside the idle list"
        assert all(self.slot[b] >= 0 and self.claims[b] == 0 for b in self._idle)

"""A linear-attention hybrid's state cache: each sequence's state slots, and its states at block boundaries.

Each running sequence holds two slots of ``StatePool``: the one a step reads and the one it writes, swapped
when the step succeeds (``ModelRunner``), so a step that fails (a poisoned row, a lost spilled block) leaves
every state as it was and the step can run again, chunk by chunk or whole.

Prefix reuse. The attention layers' blocks of a prefix are only half of it: a linear layer's state after
those tokens is the other half, and it cannot be rebuilt from blocks. So a prefix is adopted only up to a
block boundary where a snapshot of the state exists, keyed by the hash of the block that ends there (the
hash chain covers every token before it), and the state is restored with the blocks; a partial hit never
restores one without the other.

Few snapshots are kept, as SGLang's radix cache keeps them (a state where a request ended), not one per
block as vLLM's aligned mode does: each running sequence owns one slot holding its state at the latest
block boundary it crossed (rewritten as it goes), published when its prompt is done (a shared system
prompt, the next request with the same document) and when the sequence ends (the next turn of a chat,
a recompute after preemption). Published snapshots are an LRU of their own slots (``StatePool``'s
snapshot slots), evicted oldest first when a sequence needs a slot; a sequence that finds none takes no
snapshot, which costs reuse, never correctness. With lower tiers an evicted snapshot goes there
(``state_tiers``) and comes back into a snapshot slot when a prefix ending at it is looked up.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from strata.kvstore.block_table import BlockTable
from strata.kvstore.handle import HandleError
from strata.kvstore.state_pool import StatePool
from strata.kvstore.state_tiers import StateTiers


class StateCache:
    """Sequences' state slots and the snapshots they own and publish, over one state pool."""

    def __init__(self, pool: StatePool, snapshots: bool = True, below: StateTiers | None = None) -> None:
        """``snapshots``: keep states at block boundaries for prefix reuse (off with prefix caching); ``below``:
        where snapshots the device evicts are kept (the lower tiers), if anywhere."""
        self.pool = pool
        self.snapshots = snapshots and pool.num_snapshots > 0
        self.below = below if self.snapshots else None
        self.published: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, oldest first
        self.taken = 0
        self.hits = 0

    def claim(self, table: BlockTable, snapshot: bytes | None = None) -> bool:
        """The table's two state slots (read, write), zeroed or holding the published ``snapshot``; False
        with nothing claimed when the running slots are all held."""
        read, spare = self.pool.claim(), self.pool.claim()
        if read is None or spare is None:
            for slot in (read, spare):
                if slot is not None:
                    self.pool.release(slot)
            return False
        table.state_slot, table.state_spare = read, spare
        if snapshot is not None:
            self.pool.copy(self.published[snapshot], read)
            self.published.move_to_end(snapshot)
            self.hits += 1
        return True

    def release(self, table: BlockTable) -> None:
        """Publish the table's latest boundary snapshot (before its hashes go), then give its slots back."""
        self.publish(table)
        for slot in (table.state_slot, table.state_spare):
            if slot >= 0:
                self.pool.release(slot)
        table.state_slot = table.state_spare = -1

    def export(self, table: BlockTable) -> bytes:
        """The table's current state, every kind and layer, as bytes (what a hand-off ships)."""
        return self.pool.read(table.state_slot)

    def check(self, data: bytes) -> None:
        """HandleError unless ``data`` is the size of this model's state (:meth:`export`)."""
        if len(data) != self.pool.bytes_per_sequence():
            raise HandleError(f"the hand-off's linear-attention state has {len(data)} bytes; this model's has "
                              f"{self.pool.bytes_per_sequence()}")

    def install(self, table: BlockTable, data: bytes) -> bool:
        """Give the table (holding no state) slots whose state is ``data`` from :meth:`export` of the same
        model; False with nothing claimed when no slot is free. Bytes of another size are refused."""
        self.check(data)
        if not self.claim(table):
            return False
        self.pool.write(table.state_slot, data)
        return True

    def swap(self, table: BlockTable) -> None:
        """The step that read ``state_slot`` and wrote ``state_spare`` succeeded: the written one is current."""
        table.state_slot, table.state_spare = table.state_spare, table.state_slot

    def drop_snapshot(self, table: BlockTable) -> None:
        """A failed step may have half-written the table's snapshot: forget it."""
        if table.snapshot_slot >= 0:
            self.pool.release(table.snapshot_slot)
            table.snapshot_slot, table.snapshot_blocks = -1, 0

    def take(self, table: BlockTable, blocks: int) -> int | None:
        """The slot the table's state at the boundary after ``blocks`` blocks is to be copied into (its own,
        claimed on first use, evicting the oldest published snapshot if none is free); None: none to be had."""
        if not self.snapshots:
            return None
        if table.snapshot_slot < 0:
            slot = self._snapshot_slot()
            if slot is None:
                return None
            table.snapshot_slot = slot
        table.snapshot_blocks = blocks
        self.taken += 1
        return table.snapshot_slot

    def publish(self, table: BlockTable) -> None:
        """Make the table's snapshot findable by the hash of the block it ends at, if that block is published
        (else it is dropped); either way the table owns no snapshot after."""
        slot, blocks = table.snapshot_slot, table.snapshot_blocks
        if slot < 0:
            return
        table.snapshot_slot, table.snapshot_blocks = -1, 0
        key = table.hashes[blocks - 1] if 0 < blocks <= table.num_published else None
        if key is None or key in self.published:
            self.pool.release(slot)
            if key is not None:
                self.published.move_to_end(key)
            return
        self.published[key] = slot

    def _snapshot_slot(self) -> int | None:
        """A free snapshot slot, else the oldest published one's (its snapshot kept below, if there is a below)."""
        slot = self.pool.claim_snapshot()
        if slot is None and self.published:
            key, slot = self.published.popitem(last=False)
            if self.below is not None:
                self.below.store(key, self.pool.read(slot))
        return slot

    def longest(self, hashes: Sequence[bytes], limit: int) -> int:
        """The most leading blocks of ``hashes`` (at most ``limit``) that end at a published snapshot, one kept
        below brought back into a snapshot slot if need be; 0: none."""
        for blocks in range(min(limit, len(hashes)), 0, -1):
            key = hashes[blocks - 1]
            if key in self.published or (self.below is not None and self.below.has(key) and self._bring_back(key)):
                return blocks
        return 0

    def _bring_back(self, key: bytes) -> bool:
        """Publish the snapshot ``key`` kept below; False when a piece of it is gone or no slot is to be had."""
        assert self.below is not None
        data = self.below.load(key)
        if data is None:
            return False
        slot = self._snapshot_slot()
        if slot is None:
            return False
        self.pool.write(slot, data)
        self.published[key] = slot
        return True

    def stats(self) -> dict[str, int]:
        return {"published": len(self.published), "taken": self.taken, "hits": self.hits,
                **(self.below.stats() if self.below is not None else {})}

    def check_invariants(self) -> None:
        slots = list(self.published.values())
        assert len(set(slots)) == len(slots), "two published snapshots share a slot"
        assert all(s >= self.pool.num_slots for s in slots), "a snapshot sits in a running slot"
        self.pool.check_invariants()

"""Device-tier block pool: ref-counted KV blocks plus a hash-addressed prefix cache.

Every block is in exactly one state:
  * free      - ref 0, no hash; sits in ``_free``;
  * cached    - ref 0, hashed; sits in ``_evictable`` (LRU by release time) and can
                be revived by a prefix match (``incref``) or reclaimed by ``allocate``;
  * in use    - ref > 0 (hashed or not); never evicted.
The pool is not thread-safe: it is owned by a single scheduler loop.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict, deque
from typing import Mapping

import torch

from .device_kv import DeviceKV
from .layout import KVLayout
from .window_slots import WindowSlots


class NoFreeBlocksError(RuntimeError):
    """No free or evictable block is left in the pool."""


class BlockPool:
    """Owns the device KV tensors (one per cache group, ``DeviceKV``) and the bookkeeping of their blocks."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu",
                 window_slots: Mapping[int, int] | None = None) -> None:
        """``window_slots``: device slots of each sliding-window group (by group index; default
        ``num_blocks``). Such a group lends its part of a block a slot only while some table reads the
        block inside its window, or while it stays cached (``window_slots.WindowSlots``)."""
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.layout = layout
        self.num_blocks = num_blocks
        self.pool_id = uuid.uuid4().hex  # names this pool in KV handles: block ids only mean something here
        slots = dict(window_slots or {})
        self.windows: dict[int, WindowSlots] = {
            gi: WindowSlots(slots.get(gi, num_blocks), num_blocks, g.window)
            for gi, g in enumerate(layout.groups) if g.window is not None}
        self.kv = DeviceKV(layout, [self.windows[gi].num_slots if gi in self.windows else num_blocks
                                    for gi in range(len(layout.groups))], device)
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        # Metrics counters (monotonic).
        self.num_evictions = 0
        self.peak_in_use = 0  # most blocks referenced at once (device footprint high-water mark)

    # ------------------------------------------------------------ views
    def k_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, kv_heads, head_dim] view of layer's keys."""
        return self.kv.layers[layer][:, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, kv_heads, head_dim] view of layer's values."""
        return self.kv.layers[layer][:, -1]

    # ------------------------------------------------------------ allocation
    def num_free(self) -> int:
        """Blocks allocatable right now (free + evictable cached)."""
        return len(self._free) + len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free()

    def allocate(self) -> int:
        """Return a block with ref 1; evicts the LRU cached block only if nothing is free."""
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash[block_id]]  # type: ignore[index]
            self._hash[block_id] = None
            self.num_evictions += 1
            for w in self.windows.values():  # the evicted block's windowed parts leave with it
                w.drop(block_id)
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are referenced")
        self._ref[block_id] = 1
        self.peak_in_use = max(self.peak_in_use, self.num_blocks - len(self._free) - len(self._evictable))
        return block_id

    def incref(self, block_id: int) -> None:
        """Add a reference; revives a cached ref-0 block (removes it from the LRU)."""
        self._check_id(block_id)
        if self._ref[block_id] == 0:
            if block_id not in self._evictable:
                raise ValueError(f"block {block_id} is free; allocate it instead")
            del self._evictable[block_id]
        self._ref[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop a reference; at 0 a hashed block stays cached, an unhashed one is freed."""
        self._check_id(block_id)
        if self._ref[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use")
        self._ref[block_id] -= 1
        if self._ref[block_id] == 0:
            if self._hash[block_id] is not None:
                self._evictable[block_id] = None  # most recently released
            else:
                self._free.append(block_id)
                for w in self.windows.values():
                    w.drop(block_id)

    def storage_ids(self, block_id: int) -> list[int]:
        """Where each group keeps its part of ``block_id``: the id itself, or a windowed group's slot
        (-1: that part is not on the device)."""
        return [self.windows[gi].slot[block_id] if gi in self.windows else block_id
                for gi in range(len(self.layout.groups))]

    def complete(self, block_id: int) -> bool:
        """Whether every group's part of ``block_id`` is on the device (only then may its bytes be read)."""
        return all(w.has(block_id) for w in self.windows.values())

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref[block_id]

    # ------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: bytes) -> int | None:
        """Block currently cached under ``block_hash``; no ref change."""
        return self._by_hash.get(block_hash)

    def block_hash(self, block_id: int) -> bytes | None:
        self._check_id(block_id)
        return self._hash[block_id]

    def publish(self, block_id: int, block_hash: bytes) -> int:
        """Register a filled, in-use block under its hash; return the canonical block id.

        If another block already holds ``block_hash`` the existing one wins and the
        caller's block stays unhashed; no ref counts change either way (a caller that
        wants to swap must ``incref`` the returned id and ``free`` its own block).
        """
        self._check_id(block_id)
        if self._ref[block_id] <= 0:
            raise ValueError(f"block {block_id} must be in use to be published")
        current = self._hash[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} is already published under another hash")
            return block_id
        existing = self._by_hash.get(block_hash)
        if existing is not None:
            return existing
        self._hash[block_id] = block_hash
        self._by_hash[block_hash] = block_id
        return block_id

    # ------------------------------------------------------------ introspection
    def stats(self) -> dict[str, int]:
        free = len(self._free)
        cached = len(self._evictable)
        return {
            "total": self.num_blocks,
            "free": free,
            "cached": cached,
            "in_use": self.num_blocks - free - cached,
            "hashed": len(self._by_hash),
            "allocatable": free + cached,
            "evictions": self.num_evictions,
            "peak_in_use": self.peak_in_use,
        }

    def window_stats(self) -> list[dict[str, int]]:
        """Each sliding-window group's slots (``WindowSlots.stats``), in group order."""
        return [w.stats() for _, w in sorted(self.windows.items())]

    def check_invariants(self) -> None:
        """O(num_blocks) consistency check, for tests and debugging."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate in free list"
        evictable = set(self._evictable)
        assert not (free & evictable), "block both free and cached"
        for b in range(self.num_blocks):
            ref, h = self._ref[b], self._hash[b]
            assert ref >= 0
            if ref > 0:
                assert b not in free and b not in evictable, f"in-use block {b} is allocatable"
            elif h is None:
                assert b in free, f"unhashed idle block {b} not free"
            else:
                assert b in evictable, f"hashed idle block {b} not cached"
            if h is not None:
                assert self._by_hash.get(h) == b, f"hash map disagrees for block {b}"
        assert len(self._by_hash) == sum(h is not None for h in self._hash)
        for w in self.windows.values():
            w.check_invariants()
            for b in range(self.num_blocks):
                assert w.claims[b] <= self._ref[b], f"block {b} claimed in a window by more tables than hold it"
                assert not (w.has(b) and b in free), f"free block {b} keeps a windowed part"

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")

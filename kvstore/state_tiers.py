"""Linear-attention state snapshots below the device: kept in the lower tiers when the device's few snapshot
slots evict them, so a prefix whose state the device no longer holds is still reused.

A snapshot is a whole sequence's state (every linear layer, every kind), far larger than a KV block on a
real model (Qwen3-Next-80B: ~75 MiB against a 384 KiB block), so it is stored as block-sized pieces named
``hashing.state_piece_hash(block hash, i)``: the tiers hold, verify, evict and demote them like any block
(files 0600, CRC-checked, fingerprinted), and a snapshot whose piece is gone or corrupt is a miss, never a
wrong state. A lookup asks the tiers whether a snapshot's first piece is there (one ``stat`` per block
boundary tried), so a snapshot another process on the node put there, or one a server wrote before it
restarted over a disk tier, is found too; those this process queued and the writer has not landed yet are
remembered in memory (``MAX_KNOWN``, the newest).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from strata.kvstore.hashing import state_piece_hash
from strata.kvstore.lower_tiers import LowerTiers

MAX_KNOWN = 4096  # snapshots remembered as stored below, landed or still queued for the writer


class StateTiers:
    """Snapshots of ``state_bytes`` each, stored in ``lower`` as pieces of ``block_bytes``."""

    def __init__(self, lower: LowerTiers, block_bytes: int, state_bytes: int) -> None:
        self.lower = lower
        self.block_bytes = block_bytes
        self.state_bytes = state_bytes
        self.pieces = -(-state_bytes // block_bytes)
        self._known: OrderedDict[bytes, None] = OrderedDict()  # snapshot keys stored below, oldest first
        self.stored = self.loaded = self.missed = 0

    def _names(self, key: bytes) -> list[bytes]:
        return [state_piece_hash(key, i) for i in range(self.pieces)]

    def store(self, key: bytes, data: bytes) -> None:
        """Keep the snapshot named ``key`` (the hash of the block it ends at) below, written behind."""
        padded = data + bytes(self.pieces * self.block_bytes - len(data))
        view = memoryview(padded)
        self.lower.store_behind([(name, view[i * self.block_bytes : (i + 1) * self.block_bytes])
                                 for i, name in enumerate(self._names(key))])
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > MAX_KNOWN:
            self._known.popitem(last=False)
        self.stored += 1

    def has(self, key: bytes) -> bool:
        """Whether the snapshot may be below: this process stored it, or its first piece is in a tier (another
        piece may since have been evicted: :meth:`load` says)."""
        return key in self._known or self.lower.find(state_piece_hash(key, 0)) is not None

    def load(self, key: bytes) -> bytes | None:
        """The snapshot's bytes, or None when a piece is gone, cut or foreign (then forgotten here)."""
        names = self._names(key)
        self.lower.wait_for(names)  # a snapshot stored moments ago may still be queued
        out = np.empty(self.pieces * self.block_bytes, dtype=np.uint8)
        for i, name in enumerate(names):
            if not self.lower.read_block(name, out[i * self.block_bytes : (i + 1) * self.block_bytes]):
                self._known.pop(key, None)
                self.missed += 1
                return None
        self.loaded += 1
        return out[: self.state_bytes].tobytes()

    def stats(self) -> dict[str, int]:
        return {"stored_below": self.stored, "loaded_from_below": self.loaded, "missed_below": self.missed}

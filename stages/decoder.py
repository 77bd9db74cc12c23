"""Decode stage: adopts prefilled sequences by KVHandle and steps them all together (continuous batching)."""

from __future__ import annotations

from kvstore import HandleError, KVHandle
from pipeline.engine_core import EngineCore, TokenEvent
from pipeline.sequence import Sequence


class Decoder:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.scheduler = core.scheduler
        self.pool = core.scheduler.pool

    def admit(self, seq: Sequence, handle_bytes: bytes) -> None:
        """Rebuild the sequence's block table from its handle and join the running batch."""
        handle = KVHandle.from_bytes(handle_bytes, expected_fingerprint=self.scheduler.fingerprint)
        if handle.num_tokens != seq.num_tokens - 1:
            raise HandleError(f"handle covers {handle.num_tokens} tokens, sequence has {seq.num_tokens - 1} computed")
        if handle.pool_id != self.pool.pool_id:
            self._admit_from_other_pool(seq, handle)
            return
        ids = list(handle.block_ids) + ([handle.tail_block] if handle.tail_block is not None else [])
        seq.block_table.block_ids = ids
        seq.block_table.num_spilled = handle.num_spilled
        seq.block_table.num_tokens = handle.num_tokens
        seq.num_computed_tokens = handle.num_tokens
        self.scheduler.add_running(seq)

    def _admit_from_other_pool(self, seq: Sequence, handle: KVHandle) -> None:
        """Blocks made by another process: adopt the full ones by hash through the host/disk
        tiers (the scheduler's prefix match does that) and recompute the partial tail here."""
        if not self.scheduler.can_spill:
            raise HandleError("KV handle points at another block pool; adopting it needs a host or disk tier")
        seq.block_table = type(seq.block_table)(seq.block_table.block_size)
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0
        self.scheduler.add(seq)

    def step(self, budget: int | None = None) -> list[TokenEvent]:
        return self.core.step(budget)

    def abort(self, seq: Sequence) -> None:
        self.core.abort(seq)

    @property
    def last_num_tokens(self) -> int:
        return self.core.last_num_tokens

    @property
    def num_running(self) -> int:
        return self.core.num_running

    def has_work(self) -> bool:
        return self.core.has_work()

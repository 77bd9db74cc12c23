"""Decode stage: adopts prefilled sequences by KV handle and steps them all together (continuous batching)."""

from __future__ import annotations

import logging

from strata.kvstore import HandleError, KVHandle
from strata.pipeline.engine_core import EngineCore
from strata.pipeline.request import TokenEvent
from strata.pipeline.sequence import Sequence

log = logging.getLogger(__name__)


class Decoder:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.scheduler = core.scheduler
        self.kv = core.scheduler.kv

    def admit(self, seq: Sequence, kv_handle: bytes) -> None:
        """Rebuild the sequence's block table from its handle and join the running batch."""
        handle = KVHandle.from_bytes(kv_handle, expected_fingerprint=self.kv.fingerprint)
        if handle.num_tokens != seq.num_tokens - 1:
            raise HandleError(f"handle covers {handle.num_tokens} tokens, sequence has {seq.num_tokens - 1} computed")
        table = self.kv.adopt(handle)
        if table is None:
            self._admit_from_other_pool(seq)
            return
        seq.block_table = table
        seq.num_computed_tokens = handle.num_tokens
        log.debug("decode %s: admitted with %d tokens of KV in place", seq.request_id, handle.num_tokens)
        self.scheduler.add_running(seq)

    def _admit_from_other_pool(self, seq: Sequence) -> None:
        """Blocks made by another process: adopt the full ones by hash through the host/disk
        tiers (the scheduler's prefix match does that) and recompute the partial tail here."""
        if not (self.kv.can_spill and self.scheduler.config.enable_prefix_caching):
            raise HandleError("KV handle points at another block pool; adopting it needs a host or disk tier")
        seq.block_table = self.kv.new_table()
        seq.num_computed_tokens = 0
        log.debug("decode %s: admitted from another pool, adopting blocks by hash", seq.request_id)
        self.scheduler.add(seq)

    def step(self, budget: int | None = None) -> list[TokenEvent]:
        return [event for _, event in self.core.step(budget)]

    def abort(self, seq: Sequence) -> None:
        if self.core.abort(seq):
            log.debug("decode %s: aborted", seq.request_id)

    @property
    def last_num_tokens(self) -> int:
        return self.core.last_num_tokens

    @property
    def num_running(self) -> int:
        return self.core.num_running

    def has_work(self) -> bool:
        return self.core.has_work()

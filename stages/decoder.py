"""Decode stage: adopts prefilled sequences by KV handle and steps them all together (continuous batching)."""

from __future__ import annotations

import logging

from strata.kvstore import HandleError, KVHandle
from strata.pipeline.contract.request import TokenEvent
from strata.pipeline.core.engine_core import EngineCore
from strata.pipeline.core.sequence import Sequence

log = logging.getLogger(__name__)


class Decoder:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.scheduler = core.scheduler
        self.kv = core.scheduler.kv
        # Tokens of handed-over sequences this decoder took over with their KV, and those it had to
        # recompute (a block missing from the host tier, no room, no shipped tail, or FP8 KV written over
        # another node's scales).
        self.handoff_tokens = {"adopted": 0, "recomputed": 0}
        self.other_scales_tokens = 0  # of the recomputed: FP8 KV another node wrote over its own scales

    def admit(self, seq: Sequence, kv_handle: KVHandle | None, tail_kv: bytes = b"", linear_state: bytes = b"") -> None:
        """Rebuild the sequence's block table from its handle and join the running batch. ``tail_kv``
        is the partial last block a prefill on another pool shipped along, ``linear_state`` a
        linear-attention model's state after the prompt."""
        if kv_handle is None:
            raise HandleError("the hand-off carries no KV handle (its request finished at prefill)")
        if kv_handle.same_model_other_scales(self.kv.fingerprint, self.kv.model_key):
            if not self.other_scales_tokens:
                log.warning("a prefill on another node wrote this model's FP8 KV over other scales: its prompts are "
                            "recomputed here (give both nodes one digest cache, or the same scales record)")
            self.other_scales_tokens += kv_handle.num_tokens
            self._recompute(seq, kv_handle.num_tokens, "its FP8 KV was written over another node's scales")
            return
        handle = kv_handle.check(self.kv.fingerprint)
        if handle.num_tokens != seq.num_tokens - 1:
            raise HandleError(f"handle covers {handle.num_tokens} tokens, sequence has {seq.num_tokens - 1} computed")
        if self.kv.states is not None:
            if not linear_state:
                raise HandleError("the hand-off of a linear-attention model carries no state")
            self.kv.states.check(linear_state)
        table = self.kv.adopt(handle)
        if table is None or (self.kv.states is not None and not self.kv.states.install(table, linear_state)):
            if table is not None:  # no state slot free here: its blocks go, the sequence is recomputed
                self.kv.free(table)
            self._admit_from_other_pool(seq, handle, tail_kv, linear_state)
            return
        seq.block_table = table
        seq.num_computed_tokens = handle.num_tokens
        log.debug("decode %s: admitted with %d tokens of KV in place", seq.request_id, handle.num_tokens)
        self.scheduler.add_running(seq)

    def _admit_from_other_pool(self, seq: Sequence, handle: KVHandle, tail_kv: bytes, linear_state: bytes = b"") -> None:
        """Blocks made by another process: adopt the full ones by hash from the host/disk tiers and the
        partial tail from the bytes shipped with the hand-off, then decode at once. If a full block
        cannot be found or there is no room, the sequence is recomputed instead (counted)."""
        if not (self.kv.can_spill and self.scheduler.config.enable_prefix_caching):
            raise HandleError("KV handle points at another block pool; adopting it needs a host or disk tier")
        seq.block_table = table = self.kv.new_table()
        full = handle.num_tokens // self.kv.layout.block_size
        match = self.kv.match_prefix(table, handle.block_hashes[:full], keep_free=1,
                                     state=linear_state if self.kv.states is not None else None)
        complete = match.num_blocks == full and (handle.num_tokens == full * table.block_size or (
            tail_kv and self.kv.import_tail(table, tail_kv, handle.num_tokens)))
        if complete:
            table.num_tokens = handle.num_tokens
            seq.num_computed_tokens = handle.num_tokens
            self.handoff_tokens["adopted"] += handle.num_tokens
            log.debug("decode %s: adopted %d tokens of KV from another pool", seq.request_id, handle.num_tokens)
            self.scheduler.add_running(seq)
            return
        self.kv.free(table)
        self._recompute(seq, handle.num_tokens, "KV incomplete here")

    def _recompute(self, seq: Sequence, num_tokens: int, why: str) -> None:
        """The sequence's prompt computed again here (counted), its hand-off's KV not used."""
        seq.num_computed_tokens = 0
        self.handoff_tokens["recomputed"] += num_tokens
        log.debug("decode %s: %s, recomputing %d tokens", seq.request_id, why, num_tokens)
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

"""Prefill stage: chunked prefill of prompts with prefix reuse; hands each sequence off with a KV handle."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from strata.kvstore import KVHandle
from strata.pipeline.contract.request import TokenEvent
from strata.pipeline.core.engine_core import EngineCore
from strata.pipeline.core.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    """A prompt fully prefilled: its first token event and the handle to its KV blocks."""

    seq: Sequence
    event: TokenEvent
    kv_handle: KVHandle | None  # None when the first token already finished the request
    tail_kv: bytes = b""  # the partial last block, shipped when the decoder is on another pool
    linear_state: bytes = b""  # a linear-attention model's state after the prompt (no block holds it)


class Prefiller:
    def __init__(self, core: EngineCore, release_on_handoff: bool = False) -> None:
        """``release_on_handoff``: the decode stage has its own pool (another process), so drop this
        pool's references once the handle is made; full blocks stay cached here and in the host
        tier, where the decoder adopts them by hash."""
        self.core = core
        self.release_on_handoff = release_on_handoff
        self.scheduler = core.scheduler
        self.kv = core.scheduler.kv

    def add(self, seq: Sequence) -> None:
        log.debug("prefill %s: %d prompt tokens queued", seq.request_id, seq.num_prompt_tokens)
        self.scheduler.add(seq)

    def step(self, budget: int | None = None) -> list[PrefillResult]:
        """Advance every queued prompt by at most one chunk; return those that finished prefill."""
        results = []
        for seq, event in self.core.step(budget):
            if event.finished:
                results.append(PrefillResult(seq, event, None))
                continue
            # Ownership of the blocks passes to the handle: leave the batch without freeing them.
            self.scheduler.remove(seq, free_blocks=False)
            tail = self.kv.export_tail(seq.block_table) if self.release_on_handoff else b""
            state = self.kv.states.export(seq.block_table) if self.kv.states is not None else b""
            handle = self.kv.make_handle(seq.block_table, release=self.release_on_handoff)
            log.debug("prefill %s: done, %d tokens (%d cached), handing off", seq.request_id, seq.num_tokens,
                      seq.num_cached_tokens)
            results.append(PrefillResult(seq, event, handle, tail, state))
        return results

    def abort(self, seq: Sequence) -> None:
        if self.core.abort(seq):
            log.debug("prefill %s: aborted", seq.request_id)

    def set_admission_watermark(self, blocks: Callable[[], int]) -> None:
        """Keep this many blocks free when admitting new prompts (e.g. one per sequence decoding
        on the same pool), so prefill never starves running decodes."""
        self.scheduler.admission_watermark = blocks

    @property
    def last_num_tokens(self) -> int:
        return self.core.last_num_tokens

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens still to prefill (the autoscaling signal of this stage)."""
        s = self.scheduler
        return sum(q.num_tokens - q.num_computed_tokens for q in (*s.waiting, *s.running))

    def has_work(self) -> bool:
        return self.core.has_work()

"""Prefill stage: chunked prefill of prompts with prefix reuse; hands each sequence off with a KVHandle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvstore import KVHandle
from pipeline.engine_core import EngineCore, TokenEvent
from pipeline.sequence import Sequence


@dataclass
class PrefillResult:
    """A prompt fully prefilled: its first token and the handle to its KV blocks."""

    seq: Sequence
    first: TokenEvent
    handle: bytes | None  # None when the first token already finished the request


class Prefiller:
    def __init__(self, core: EngineCore, release_on_handoff: bool = False) -> None:
        """``release_on_handoff``: the decode stage has its own pool (another process), so drop this
        pool's references once the handle is made; full blocks stay cached here and in the host
        tier, where the decoder adopts them by hash."""
        self.core = core
        self.release_on_handoff = release_on_handoff
        self.scheduler = core.scheduler
        self.pool = core.scheduler.pool

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def step(self, budget: int | None = None) -> list[PrefillResult]:
        """Advance every queued prompt by at most one chunk; return those that finished prefill."""
        results = []
        for event in self.core.step(budget):
            seq = event.seq
            if event.finished:
                results.append(PrefillResult(seq, event, None))
                continue
            # Ownership of the blocks passes to the handle: leave the batch without freeing them.
            self.scheduler.remove(seq, free_blocks=False)
            handle = self.make_handle(seq).to_bytes()
            if self.release_on_handoff:
                self.scheduler.release_blocks(seq)
            results.append(PrefillResult(seq, event, handle))
        return results

    def make_handle(self, seq: Sequence) -> KVHandle:
        table = seq.block_table
        full = table.num_full_blocks()
        hashes = seq.full_block_hashes(self.scheduler.fingerprint, full)
        resident_full = full - table.num_spilled
        tail = table.block_ids[resident_full] if len(table.block_ids) > resident_full else None
        return KVHandle(
            fingerprint=self.scheduler.fingerprint,
            layout=self.pool.layout,
            num_tokens=seq.num_computed_tokens,
            block_hashes=hashes,
            block_ids=list(table.block_ids[:resident_full]),
            pool_id=self.pool.pool_id,
            tail_block=tail,
            num_spilled=table.num_spilled,
        )

    def abort(self, seq: Sequence) -> None:
        self.core.abort(seq)

    def set_admission_watermark(self, blocks: Callable[[], int]) -> None:
        """Keep this many blocks free when admitting new prompts (e.g. one per sequence decoding
        on the same pool), so prefill never starves running decodes."""
        self.scheduler.admission_watermark = blocks

    @property
    def last_num_tokens(self) -> int:
        """Tokens computed by the latest step (shares one per-step budget with the decoder)."""
        return self.core.last_num_tokens

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens still to compute (the prefill stage's autoscaling signal)."""
        seqs = list(self.scheduler.waiting) + self.scheduler.running
        return sum(s.num_tokens - s.num_computed_tokens for s in seqs)

    def has_work(self) -> bool:
        return self.core.has_work()

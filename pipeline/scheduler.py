"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running sequences that decode go first (one token each), then running
sequences mid-prefill, then waiting sequences, each prefill chunk capped by
``prefill_chunk_tokens`` and all of it by ``max_num_batched_tokens``. When the block
pool runs dry, and lower KV tiers exist, leading full blocks of the sequence whose spill
frees the most device blocks are spilled (attention streams them back); without lower tiers, or
when nothing can be spilled, the newest running sequence is preempted by recompute: its
blocks are released (full ones stay in the prefix cache) and it goes back to the front
of the queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kvstore import TieredKVCache
from pipeline.config import EngineConfig
from pipeline.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position computed this step
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """This chunk reaches the last known token, so its logits give the next token."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: TieredKVCache, fingerprint: bytes) -> None:
        self.config = config
        self.kv = kv
        self.pool = kv.pool
        # Spilling needs block hashes (published blocks) and somewhere to spill them to.
        self.can_spill = kv.can_spill and config.enable_prefix_caching
        self.fingerprint = fingerprint
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Blocks to leave free when admitting new prompts (e.g. one per sequence decoding
        # elsewhere on the same pool), so admissions do not starve running decodes.
        self.admission_watermark: Callable[[], int] = lambda: 0
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Adopt a sequence whose KV is already in the pool (hand-off from a prefill stage)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence, free_blocks: bool = True) -> bool:
        """Take a sequence out of this scheduler; release its blocks unless another owner takes them.

        Returns False (and touches nothing) if this scheduler does not hold the sequence.
        """
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            return False
        if free_blocks:
            self.release_blocks(seq)
        return True

    def release_blocks(self, seq: Sequence) -> None:
        self.kv.release(seq.block_table, seq.block_hashes)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------
    def schedule(self, budget: int | None = None) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens if budget is None else budget
        scheduled: set[int] = set()
        order = sorted(self.running, key=lambda s: s.is_prefilling)  # stable: decodes first
        for seq in order:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.config.prefill_chunk_tokens)
            if n <= 0:
                continue
            if not self._reserve_or_preempt(seq, n, scheduled, out):
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            scheduled.add(id(seq))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            chunk.seq.status = SequenceStatus.RUNNING
            self.running.append(chunk.seq)
            out.chunks.append(chunk)
            budget -= chunk.num_tokens
        return out

    def _reserve_or_preempt(self, seq: Sequence, n: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        needed = seq.block_table.blocks_needed(seq.num_computed_tokens + n)
        self._spill_until_free(needed)
        while self.pool.num_free() < needed:
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            victim = victims[-1] if victims else seq
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        self._allocate(seq, needed)
        return True

    def _admit(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        if seq.num_computed_tokens == 0 and not seq.block_table.block_ids:
            self._match_prefix(seq)
        n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.config.prefill_chunk_tokens)
        needed = seq.block_table.blocks_needed(seq.num_computed_tokens + n)
        self._spill_until_free(needed + self.admission_watermark(), extra=seq)
        if self.pool.num_free() < needed + self.admission_watermark():
            self.release_blocks(seq)  # don't hold cached blocks while waiting
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            return None
        self._allocate(seq, needed)
        return ScheduledChunk(seq, seq.num_computed_tokens, n)

    def _match_prefix(self, seq: Sequence) -> None:
        if not self.config.enable_prefix_caching:
            return
        bs = self.config.block_size
        # Always leave the last token to compute: its logits are what the step samples from.
        limit = (seq.num_tokens - 1) // bs
        hashes = seq.full_block_hashes(self.fingerprint, limit)
        # Keep device room for the first chunk; matched blocks beyond that stay in their tier.
        reserve = -(-self.config.prefill_chunk_tokens // bs) + 1 + self.admission_watermark()
        matched = self.kv.match_prefix(seq.block_table, hashes, reserve)
        seq.num_computed_tokens = matched * bs
        seq.num_published_blocks = matched
        if not seq.output_token_ids:  # a recompute or hand-off keeps the first admission's figure
            seq.num_cached_tokens = matched * bs

    def _spill_until_free(self, needed: int, extra: Sequence | None = None) -> None:
        """Spill leading published blocks until ``needed`` blocks are allocatable, each time from the
        sequence whose spill frees the most device blocks (blocks shared with other sequences free
        nothing, so a shared prefix is not streamed for no gain). Stops when nothing would free."""
        if not self.can_spill:
            return
        candidates = self.running + ([extra] if extra is not None else [])
        while self.pool.num_free() < needed:
            want = needed - self.pool.num_free()
            plans = [(self.kv.spill_plan(s.block_table, s.num_published_blocks, want), s) for s in candidates]
            (count, freed), best = max(plans, key=lambda p: p[0][1], default=((0, 0), None))
            if best is None or freed == 0:
                return
            if self.kv.spill(best.block_table, best.block_hashes, count) == 0:
                return

    def _allocate(self, seq: Sequence, count: int) -> None:
        for _ in range(count):
            seq.block_table.block_ids.append(self.pool.allocate())

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, requeue at the front."""
        self.running.remove(seq)
        self.release_blocks(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # -- after the model ran -------------------------------------------------
    def commit(self, chunk: ScheduledChunk) -> None:
        """Record computed KV and publish newly full blocks to the prefix cache."""
        seq = chunk.seq
        seq.num_computed_tokens = chunk.end
        seq.block_table.num_tokens = chunk.end
        if self.config.enable_prefix_caching:
            self.publish_full_blocks(seq)

    def publish_full_blocks(self, seq: Sequence) -> None:
        full = seq.block_table.num_full_blocks()
        if full <= seq.num_published_blocks:
            return
        hashes = seq.full_block_hashes(self.fingerprint, full)
        self.kv.publish(seq.block_table, hashes, seq.num_published_blocks, full)
        seq.num_published_blocks = full

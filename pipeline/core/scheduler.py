"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running sequences that decode go first (one token each), then running
sequences mid-prefill, then waiting sequences, each prefill chunk capped by
``prefill_chunk_tokens`` and all of it by ``max_num_batched_tokens``. When the KV store
cannot make room (it first spills published blocks to the lower tiers, when there are any),
the newest running sequence is preempted by recompute: its blocks are released (full ones
stay in the prefix cache) and it goes back to the front of the queue.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from strata.kvstore import TieredKVCache
from strata.kvstore.hashing import prompt_seed
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.core.sequence import Sequence, SequenceStatus


SCORED_CHUNK_TOKENS = 512  # the most prompt rows one step scores for one request (0.3 GB of logits at 150K vocab)


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position computed this step
    num_tokens: int  # known tokens plus draft tokens
    draft: list[int] = field(default_factory=list)  # speculative tokens after the last known one, verified this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """This chunk reaches the last known token, so its logits give the next token (one row per
        token from there on when it carries a draft)."""
        return self.end - len(self.draft) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Policy only: who runs, who waits, who is preempted. Block arithmetic is the KV store's."""

    def __init__(self, config: EngineConfig, kv: TieredKVCache) -> None:
        self.config = config
        self.kv = kv
        self.fingerprint = kv.fingerprint
        self.prompt_keyed = kv.prompt_keyed  # DSA: blocks are named by their prompt's length too (``hashing.prompt_seed``)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Blocks to leave free when admitting new prompts (e.g. one per sequence decoding
        # elsewhere on the same pool), so admissions do not starve running decodes.
        self.admission_watermark: Callable[[], int] = lambda: 0
        # Whether a sequence may run now (False: its grammar is still compiling; it keeps its place and its
        # blocks while the others step). ``num_held``: how many this step held back.
        self.ready: Callable[[Sequence], bool] = lambda seq: True
        self.num_held = 0
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
            self.kv.free(seq.block_table)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------
    def schedule(self, budget: int | None = None) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens if budget is None else budget
        scheduled: set[int] = set()
        held: list[Sequence] = []
        order = sorted(self.running, key=lambda s: s.is_prefilling)  # stable: decodes first
        for seq in order:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not self.ready(seq):
                held.append(seq)
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self._chunk_limit(seq))
            if n <= 0:
                continue
            draft = seq.draft[: budget - 1] if n == 1 and seq.num_tokens - seq.num_computed_tokens == 1 else []
            if draft and not self.kv.reserve(seq.block_table, seq.num_computed_tokens + 1 + len(draft)):
                draft = []  # a draft never preempts anyone: without room it waits for a roomier step
            n += len(draft)
            if not self._reserve_or_preempt(seq, n, scheduled, out):
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n, draft))
            scheduled.add(id(seq))
            budget -= n
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not out.preempted:
            if not self.ready(self.waiting[0]):  # held in its place; the ones behind it may go
                skipped.append(self.waiting.popleft())
                continue
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            chunk.seq.status = SequenceStatus.RUNNING
            self.running.append(chunk.seq)
            out.chunks.append(chunk)
            budget -= chunk.num_tokens
        self.waiting.extendleft(reversed(skipped))
        self.num_held = len(held) + len(skipped)
        self._prefetch_waiting()
        return out

    def _prefetch_waiting(self, lookahead: int = 2) -> None:
        """Ask the KV store to read ahead the cached prefix of the next prompts to admit, while this step's
        forward runs (each prompt once)."""
        if not (self.config.enable_prefix_caching and self.kv.can_spill):
            return
        for seq in itertools.islice(self.waiting, lookahead):
            if not seq.prefetched and seq.num_computed_tokens == 0 and seq.block_table.is_empty() \
                    and seq.params.prompt_logprobs is None:
                seq.prefetched = True
                self.kv.prefetch(seq.full_block_hashes(self._seed(seq), self.kv.matchable_blocks(seq.num_tokens)))

    def _reserve_or_preempt(self, seq: Sequence, n: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Room for ``n`` more tokens of ``seq``, preempting the newest unscheduled sequence (or
        ``seq`` itself, last) until the KV store has it."""
        while not self.kv.reserve(seq.block_table, seq.num_computed_tokens + n):
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            victim = victims[-1] if victims else seq
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _chunk_limit(self, seq: Sequence) -> int:
        """Tokens of ``seq`` one step may compute: a prompt-logprobs prompt's chunk returns a [tokens, vocab]
        fp32 logits block, so it is held to ``SCORED_CHUNK_TOKENS`` whatever the configured chunk."""
        if seq.params.prompt_logprobs is not None and not seq.output_token_ids:
            return min(self.config.prefill_chunk_tokens, SCORED_CHUNK_TOKENS)
        return self.config.prefill_chunk_tokens

    def _admit(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        if seq.num_computed_tokens == 0 and seq.block_table.is_empty():
            self._match_prefix(seq)
        n = min(seq.num_tokens - seq.num_computed_tokens, budget, self._chunk_limit(seq))
        if not self.kv.reserve(seq.block_table, seq.num_computed_tokens + n, keep_free=self.admission_watermark()):
            self.kv.free(seq.block_table)  # don't hold cached blocks while waiting
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            return None
        return ScheduledChunk(seq, seq.num_computed_tokens, n)

    def _seed(self, seq: Sequence) -> bytes:
        """The seed of ``seq``'s block-hash chain: the model's fingerprint, with its prompt's length when the
        model's KV depends on it."""
        return prompt_seed(self.fingerprint, seq.num_prompt_tokens) if self.prompt_keyed else self.fingerprint

    def _match_prefix(self, seq: Sequence) -> None:
        if not self.config.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return  # prompt logprobs need every prompt row computed (``core.prompt_logprobs``)
        hashes = seq.full_block_hashes(self._seed(seq), self.kv.matchable_blocks(seq.num_tokens))
        if seq.lost_blocks:  # never again past a block this sequence found lost
            hashes = hashes[: next((i for i, h in enumerate(hashes) if h in seq.lost_blocks), len(hashes))]
        # Keep device room for the first chunk; matched blocks beyond that stay in their tier.
        keep_free = self.kv.chunk_working_set(self.config.prefill_chunk_tokens) + self.admission_watermark()
        match = self.kv.match_prefix(seq.block_table, hashes, keep_free)
        seq.num_computed_tokens = match.num_tokens
        if not seq.output_token_ids:  # a recompute or hand-off keeps the first admission's figure
            seq.num_cached_tokens = match.num_tokens

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, requeue at the front."""
        self.running.remove(seq)
        self.kv.free(seq.block_table)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # -- after the model ran -------------------------------------------------
    def commit(self, chunk: ScheduledChunk, end: int | None = None) -> None:
        """Record computed KV up to ``end`` (default: the chunk's end; a verified draft keeps only its
        accepted tokens, and the slots past them are written again next step); newly full blocks are
        published to the prefix cache."""
        seq = chunk.seq
        end = chunk.end if end is None else end
        seq.num_computed_tokens = end
        table = seq.block_table
        full = table.num_full_blocks(end)
        publish = self.config.enable_prefix_caching and full > table.num_published
        self.kv.commit(table, end, seq.full_block_hashes(self._seed(seq), full) if publish else ())
        if self.kv.states is not None and chunk.samples and not seq.output_token_ids:
            self.kv.states.publish(table)  # the prompt's state at its last block boundary: the next alike finds it

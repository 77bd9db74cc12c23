"""Scheduler + model runner + sampler over one KV store: the loop every LLM stage runs."""

from __future__ import annotations

from typing import Callable

from strata.kvstore import KVBlockLostError
from strata.pipeline.model_runner import ModelRunner
from strata.pipeline.request import TokenEvent
from strata.pipeline.sampler import Sampler, check_stop
from strata.pipeline.scheduler import ScheduledChunk, Scheduler
from strata.pipeline.sequence import Sequence, SequenceStatus

Detokenize = Callable[[list[int]], str]


Emitted = tuple[Sequence, TokenEvent]  # an event and the sequence it came from (stages need both)


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        detokenize: Detokenize,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = Sampler()
        self.detokenize = detokenize
        self.eos_token_ids = eos_token_ids
        self.steps = 0
        self.last_num_tokens = 0  # tokens computed by the latest step (for a shared per-step budget)

    def step(self, budget: int | None = None) -> list[Emitted]:
        """Schedule, run the model once, sample, update sequences. Empty if nothing could run."""
        out = self.scheduler.schedule(budget)
        self.last_num_tokens = 0
        if not out.chunks:
            return []
        self.last_num_tokens = out.num_tokens
        try:
            logits = self.runner.execute(out.chunks)
        except KVBlockLostError as lost:
            self._recompute_readers_of(lost.block_hash, out.chunks)
            return []
        for chunk in out.chunks:
            self.scheduler.commit(chunk)
        sampling = [c.seq for c in out.chunks if c.samples]
        tokens = self.sampler.sample(logits, [s.params for s in sampling], [s.generator for s in sampling])
        self.steps += 1
        return [self._append(seq, tok) for seq, tok in zip(sampling, tokens)]

    def _recompute_readers_of(self, block_hash: bytes, chunks: list[ScheduledChunk]) -> None:
        """A spilled block vanished (corrupt or deleted file): recompute every sequence that read it.
        Nothing was committed, so the other chunks simply run again next step."""
        for chunk in chunks:
            seq = chunk.seq
            table = seq.block_table
            if seq.status is SequenceStatus.RUNNING and block_hash in table.hashes[: table.num_spilled]:
                self.scheduler.preempt(seq)

    def _append(self, seq: Sequence, token: int) -> Emitted:
        prev_len = len(seq.text)
        seq.token_ids.append(token)
        output_ids = seq.output_token_ids
        text = seq.text + seq.detokenizer.step(self.detokenize, output_ids)
        result = check_stop(output_ids, self.eos_token_ids, seq.params, text, prev_len)
        finished = result.finish_reason is not None
        seq.text = result.text
        if finished and not isinstance(result.stop_reason, str):
            # eos, stop token or length: flush a dangling partial character, as a full decode shows it
            seq.text += seq.detokenizer.step(self.detokenize, output_ids, final=True)
        stable = len(seq.text) if finished else self._streamable_len(seq)
        delta = seq.text[seq.emitted_text_len : stable] if stable > seq.emitted_text_len else ""
        seq.emitted_text_len = max(seq.emitted_text_len, stable)
        if finished:
            seq.finish_reason = result.finish_reason
            self.finish(seq)
        return seq, TokenEvent(seq.request_id, token, delta, seq.finish_reason if finished else None,
                               seq.num_cached_tokens)

    @staticmethod
    def _streamable_len(seq: Sequence) -> int:
        """Text that can no longer change: hold back a trailing partial UTF-8 character, and the
        last len(stop)-1 characters, which could still turn out to start a stop string."""
        text = seq.text.rstrip("\ufffd")
        hold = max((len(s) for s in seq.params.stop), default=1) - 1
        return max(0, len(text) - hold)

    def finish(self, seq: Sequence) -> None:
        """Leave the batch; full blocks stay in the prefix cache for the next turn of the chat."""
        seq.status = SequenceStatus.FINISHED
        self.scheduler.remove(seq, free_blocks=True)

    def abort(self, seq: Sequence) -> bool:
        """Cancel a sequence this core holds and free its blocks; False if it is not here."""
        if not self.scheduler.remove(seq, free_blocks=True):
            return False
        seq.finish_reason = seq.finish_reason or "abort"
        seq.status = SequenceStatus.FINISHED
        return True

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_work(self) -> bool:
        return self.scheduler.has_work()


def eos_ids_from(*candidates: object) -> tuple[int, ...]:
    ids: list[int] = []
    for c in candidates:
        if isinstance(c, int):
            ids.append(c)
        elif isinstance(c, (list, tuple)):
            ids.extend(int(x) for x in c)
    return tuple(dict.fromkeys(ids))


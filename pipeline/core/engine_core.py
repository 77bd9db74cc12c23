"""Scheduler + model runner + sampler over one KV store: the loop every LLM stage runs.

A failure inside the step fails the sequences it belongs to, never the batch: a forward that raises
is rerun chunk by chunk to find its culprits; a row of NaN logits fails its own sequence; a spilled
block that turns out to be lost sends its readers back to recompute (never to read it again), and a
sequence that keeps losing blocks, or outlives ``request_timeout_s``, ends with an error event.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import torch

from strata.kvstore import KVBlockLostError
from strata.pipeline.contract.request import TokenEvent
from strata.pipeline.core.logits_processors import apply_logits_processors, needs_processing
from strata.pipeline.core.model_runner import ModelRunner
from strata.pipeline.core.mtp_drafts import MTPProposer, step_next_tokens
from strata.pipeline.core.prompt_logprobs import take_prompt_rows, wants_prompt_rows
from strata.pipeline.core.grammar import GrammarRunner
from strata.pipeline.core.sampler import FINISH_STOP, INVALID, Logprobs, Sampler, StopResult, check_stop, row_is_finite
from strata.pipeline.core.scheduler import ScheduledChunk, Scheduler
from strata.pipeline.core.sequence import Sequence, SequenceStatus
from strata.pipeline.core.speculation import NgramProposer, SpeculationStats, verify

Detokenize = Callable[..., str]  # (ids, skip_special_tokens=True) -> text


Emitted = tuple[Sequence, TokenEvent]  # an event and the sequence it came from (stages need both)
log = logging.getLogger(__name__)
MAX_KV_LOSSES = 16  # lost spilled blocks a sequence may recompute past before it fails
INTERNAL_ERROR = "an internal error stopped this request"  # a fault of ours in one row: no internals in it
INVALID_VALUES = "the model produced invalid values (NaN or inf) for this request"


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        detokenize: Detokenize,
        eos_token_ids: tuple[int, ...],
        request_timeout_s: float = 0.0,
        grammar: GrammarRunner | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.request_timeout_s = request_timeout_s  # 0: no deadline
        self.runner = runner
        self.sampler = Sampler()
        self.detokenize = detokenize
        self.eos_token_ids = eos_token_ids
        self.grammar = grammar  # structured output (None: requests with a grammar fail)
        if grammar is not None:  # a constrained sequence runs once its grammar is compiled (off this loop)
            scheduler.ready = grammar.ready
        self.steps = 0
        self.last_num_tokens = 0  # tokens computed by the latest step (for a shared per-step budget)
        self.failed: list[Emitted] = []  # error events of sequences failed outside a step's result
        self.num_failed = 0
        spec = scheduler.config.speculative
        self.proposer: NgramProposer | MTPProposer | None = None
        if spec is not None:
            self.proposer = MTPProposer(runner) if spec.method == "mtp" else NgramProposer(spec)
        self.speculation = SpeculationStats()

    def step(self, budget: int | None = None) -> list[Emitted]:
        """Schedule, run the model once, sample, update sequences. Empty if nothing could run."""
        events, self.failed = self.failed, []
        self._expire()
        if self.proposer is not None:
            self._propose()
        out = self.scheduler.schedule(budget)
        self.last_num_tokens = 0
        if not out.chunks:
            if self.grammar is not None and self.scheduler.num_held:  # only compiling grammars left: wait a little
                self.grammar.wait(0.005)
            return events + self._take_failed()
        self.last_num_tokens = out.num_tokens
        whole = True  # the batch ran as one forward (the MTP drafter reads its hidden rows)
        try:
            logits = self.runner.execute(out.chunks)
            chunks = out.chunks
        except KVBlockLostError as lost:
            self._recompute_readers_of(lost.block_hash, out.chunks)
            return events + self._take_failed()
        except Exception:
            logits, chunks = self._isolate(out.chunks)
            whole = False
        logits, bad_rows = take_prompt_rows(logits, chunks)  # before commit: it reads what the chunk computed
        for seq in bad_rows:
            self.fail(seq, INVALID_VALUES)
        chunks = [c for c in chunks if c.seq not in bad_rows]
        verifying: list[tuple[ScheduledChunk, torch.Tensor]] = []
        if any(c.draft for c in chunks):
            logits, verifying = _split_draft_rows(logits, chunks)
        sampling_chunks = [c for c in chunks if c.samples and not c.draft]
        sampling = [c.seq for c in sampling_chunks]
        tokens, failed, logprobs = self._sample(logits, sampling)
        verified = [(chunk, self._verified(chunk, rows)) for chunk, rows in verifying]
        if isinstance(self.proposer, MTPProposer) and whole:  # before commit: published blocks hold its KV
            next_tokens = step_next_tokens(chunks, sampling_chunks, tokens, failed, verified)
            self.proposer.draft_after(out.chunks, next_tokens)
        for chunk in chunks:
            if not chunk.draft:  # a verified draft commits what it accepted, below
                self.scheduler.commit(chunk)
        self.steps += 1
        for i, (seq, tok) in enumerate(zip(sampling, tokens)):
            try:
                why = failed.get(i)
                if why is None and tok == INVALID:
                    why = INVALID_VALUES
                if why is None and self.grammar is not None:
                    why = self.grammar.accept(seq, tok)
                if why is None:
                    stops = self.grammar.stop_applies(seq, tok) if self.grammar is not None else True
                    events.append(self._append(seq, tok, logprobs, i, stops))
                    continue
                log.warning("request %s: %s", seq.request_id, why)
            except Exception:  # this row's stop rules, detokenizing or grammar: it fails alone
                log.exception("request %s: finishing its step failed", seq.request_id)
                why = INTERNAL_ERROR
            self.fail(seq, why)
        for chunk, accepted in verified:
            if accepted is not None:
                events.extend(self._keep_verified(chunk, accepted))
        return events + self._take_failed()

    def _propose(self) -> None:
        """Draft the next step's tokens of every decoding sequence that may speculate: no grammar (its
        matcher takes tokens one by one), no logits processors or logprobs (they are per position)."""
        max_len = self.scheduler.config.max_model_len
        for seq in self.scheduler.running:
            p = seq.params
            seq.draft = []
            if seq.num_tokens - seq.num_computed_tokens != 1 or not seq.output_token_ids or p.structured is not None \
                    or p.logprobs is not None or needs_processing(p):
                continue
            limit = min(p.max_tokens - len(seq.output_token_ids), max_len - seq.num_tokens) - 1
            if seq.draft_limit:
                limit = min(limit, seq.draft_limit)
            seq.draft = self.proposer.propose(seq, limit)  # type: ignore[union-attr]

    def _verified(self, chunk: ScheduledChunk, rows: torch.Tensor) -> list[int] | None:
        """What the target model agrees with (:func:`~strata.pipeline.core.speculation.verify`): the accepted
        drafts and the target's next token; None when the row failed (its sequence is failed)."""
        seq = chunk.seq
        try:
            if not bool(torch.isfinite(rows).all()):
                self.fail(seq, INVALID_VALUES)
                return None
            return verify(rows, chunk.draft, seq.params, seq.generator)
        except Exception:
            log.exception("request %s: verifying its draft failed", seq.request_id)
            self.fail(seq, INTERNAL_ERROR)
            return None

    def _keep_verified(self, chunk: ScheduledChunk, tokens: list[int]) -> list[Emitted]:
        """Emit a verified draft's tokens, and keep the KV of the accepted ones."""
        seq = chunk.seq
        stats = self.speculation
        stats.verifications += 1
        stats.drafted += len(chunk.draft)
        stats.accepted += len(tokens) - 1
        seq.draft_limit = self.proposer.next_limit(len(chunk.draft), len(tokens) - 1)  # type: ignore[union-attr]
        events = []
        try:
            for token in tokens:
                events.append(self._append(seq, token))
                if seq.status is SequenceStatus.FINISHED:
                    return events  # the answer ended inside the draft: its blocks are freed
            # the known token and the accepted drafts hold KV now; the slots past them are written again next step
            self.scheduler.commit(chunk, chunk.start + len(tokens))
        except Exception:  # this row's stop rules or detokenizing: it fails alone
            log.exception("request %s: finishing its step failed", seq.request_id)
            self.fail(seq, INTERNAL_ERROR)
        return events

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], dict[int, str], Logprobs | None]:
        """Tokens, the rows that failed (row -> why) and logprobs of one step's sampling rows. The batch is
        sampled at once; if that raises (one row's logits processor, grammar or sampler), each row is
        sampled on its own, so only the rows that still raise fail."""
        try:
            tokens, failed = sample_rows(self.sampler, self.grammar, logits, seqs, self.eos_token_ids)
            return tokens, failed, self.sampler.logprobs(logits, tokens, [s.params for s in seqs])
        except Exception:
            log.exception("sampling a step of %d rows failed; sampling them one by one", len(seqs))
        tokens, failed, chosen, top = [], {}, [], []
        for i, seq in enumerate(seqs):
            row = logits[i : i + 1]
            try:
                (token,), why = sample_rows(self.sampler, self.grammar, row, [seq], self.eos_token_ids)
                one = self.sampler.logprobs(row, [token], [seq.params])
            except Exception:
                log.exception("request %s: sampling its row failed", seq.request_id)
                token, why, one = INVALID, {0: INTERNAL_ERROR}, None
            tokens.append(token)
            if 0 in why:
                failed[i] = why[0]
            chosen.append(one.chosen[0] if one is not None else None)
            top.append(one.top[0] if one is not None else None)
        return tokens, failed, Logprobs(chosen, top)

    def _take_failed(self) -> list[Emitted]:
        failed, self.failed = self.failed, []
        return failed

    def _isolate(self, chunks: list[ScheduledChunk]):
        """The batched forward raised: run each chunk on its own, fail the ones that still raise, and
        return the others' logits (a poisoned request cannot take its batch down with it)."""
        rows, good = [], []
        for chunk in chunks:
            try:
                logits = self.runner.execute([chunk])
            except KVBlockLostError as lost:
                self._recompute_readers_of(lost.block_hash, [chunk])
                continue
            except Exception:
                log.exception("request %s: its step failed", chunk.seq.request_id)
                self.fail(chunk.seq, INTERNAL_ERROR)
                continue
            good.append(chunk)
            if chunk.samples or wants_prompt_rows(chunk):
                rows.append(logits)
        logits = torch.cat(rows) if rows else torch.empty(0, 0)
        return logits, good

    def fail(self, seq: Sequence, message: str) -> None:
        """End a sequence with an error event (delivered with the next step's events); frees its KV."""
        if self.scheduler.remove(seq, free_blocks=True):
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "error"
            self.num_failed += 1
            self.failed.append((seq, TokenEvent.failure(seq.request_id, message)))

    def _expire(self) -> None:
        """Fail sequences older than the per-request deadline (checked once per step, O(sequences))."""
        if self.request_timeout_s <= 0:
            return
        horizon = time.monotonic() - self.request_timeout_s
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.arrival < horizon:
                log.warning("request %s: past its %.0f s deadline", seq.request_id, self.request_timeout_s)
                self.fail(seq, f"the request did not finish within {self.request_timeout_s:.0f} s")

    def _recompute_readers_of(self, block_hash: bytes, chunks: list[ScheduledChunk]) -> None:
        """A spilled block vanished (corrupt or deleted file): recompute every sequence that read it, and
        never look the block up again for it; a sequence that keeps losing blocks fails. Nothing was
        committed, so the other chunks simply run again next step."""
        readers = [c.seq for c in chunks if c.seq.status is SequenceStatus.RUNNING
                   and block_hash in c.seq.block_table.hashes[: c.seq.block_table.num_spilled]]
        if not readers:  # cannot tell who read it: every chunk with spilled blocks recomputes
            readers = [c.seq for c in chunks if c.seq.status is SequenceStatus.RUNNING and c.seq.block_table.num_spilled]
        for seq in readers:
            seq.lost_blocks.add(block_hash)
            seq.kv_losses += 1
            if seq.kv_losses > MAX_KV_LOSSES:
                self.fail(seq, "the request's cached KV kept disappearing from the host/disk tiers")
            else:
                self.scheduler.preempt(seq)

    def _append(self, seq: Sequence, token: int, logprobs: Logprobs | None = None, row: int = 0,
                stops: bool = True) -> Emitted:
        """``stops``: a stop token (EOS, ``stop_token_ids``) ends the answer here; False where a grammar took it
        as content (its language was not complete yet)."""
        prev_len = len(seq.text)
        seq.token_ids.append(token)
        output_ids = seq.output_token_ids
        decode, text_ids = self.detokenize, output_ids
        if not seq.params.skip_special_tokens:
            decode = functools.partial(self.detokenize, skip_special_tokens=False)
        ends = stops and (token in seq.params.stop_token_ids or (token in self.eos_token_ids and not seq.params.ignore_eos))
        # special tokens kept as text: the token that ends the answer is not; and a constrained answer's text is
        # its grammar's language, which the stop token ending it is outside of
        if ends and (not seq.params.skip_special_tokens or seq.grammar_stop):
            text_ids = output_ids[:-1]
        text = seq.text + seq.detokenizer.step(decode, text_ids)
        result = check_stop(output_ids, self.eos_token_ids, seq.params, text, prev_len, stop_tokens=stops)
        if result.finish_reason is None and self.grammar is not None and self.grammar.finished(seq):
            result = StopResult(FINISH_STOP, result.text)  # the grammar is complete: nothing more may follow
        finished = result.finish_reason is not None
        seq.text = result.text
        if finished and not isinstance(result.stop_reason, str):
            # eos, stop token or length: flush a dangling partial character, as a full decode shows it
            seq.text += seq.detokenizer.step(decode, text_ids, final=True)
        stable = len(seq.text) if finished else self._streamable_len(seq)
        delta = seq.text[seq.emitted_text_len : stable] if stable > seq.emitted_text_len else ""
        seq.emitted_text_len = max(seq.emitted_text_len, stable)
        if finished:
            seq.finish_reason = result.finish_reason
            self.finish(seq)
        event = TokenEvent(seq.request_id, token, delta, seq.finish_reason if finished else None, seq.num_cached_tokens)
        if seq.params.prompt_logprobs is not None and len(output_ids) == 1:  # the first token carries them
            event.prompt_logprobs = seq.prompt_logprobs
        if logprobs is not None and logprobs.chosen[row] is not None:
            event.logprob, event.top_logprobs = logprobs.chosen[row], logprobs.top[row]
        return seq, event

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


def speculation_stats(core: EngineCore) -> dict[str, dict[str, int]]:
    """``{"speculation": totals}`` for a stage's stats where speculative decoding is on, else nothing."""
    return {"speculation": core.speculation.to_dict()} if core.proposer is not None else {}


def _split_draft_rows(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[tuple[ScheduledChunk, torch.Tensor]]]:
    """The rows of a step's logits sampled one per chunk, and each draft-carrying chunk with its 1 + len(draft) rows."""
    plain: list[int] = []
    verifying = []
    row = 0
    for chunk in chunks:
        if not chunk.samples:
            continue
        if chunk.draft:
            verifying.append((chunk, logits[row : row + 1 + len(chunk.draft)]))
            row += 1 + len(chunk.draft)
        else:
            plain.append(row)
            row += 1
    return logits[plain], verifying


def sample_rows(sampler: Sampler, grammar: GrammarRunner | None, logits: torch.Tensor, seqs: list[Sequence],
                eos_token_ids: tuple[int, ...]) -> tuple[list[int], dict[int, str]]:
    """One token per sampling row: the requests' logits processors and grammars, then the sampler; and the
    rows whose grammar failed (row -> why; their tokens mean nothing). A row is invalid (:data:`INVALID`)
    only for the model's own non-finite values, never for the -inf a mask puts. Where ``min_tokens`` would
    leave a constrained row no token at all (the grammar allows only stop tokens), the grammar wins: that
    row is masked again without it."""
    processed = apply_logits_processors(logits, seqs, eos_token_ids)
    failed: dict[int, str] = {}
    if grammar is not None:
        processed, failed = grammar.mask(processed, seqs)
    finite = row_is_finite(logits) if processed is not logits and logits.numel() else None  # the model's own values
    if finite is not None:
        empty = [i for i in ((processed.amax(dim=-1) == float("-inf")) & finite).nonzero().flatten().tolist()
                 if i not in failed]
        # min_tokens holds stop tokens off; where a grammar allows nothing else, the grammar wins
        again = [i for i in empty if grammar is not None and seqs[i].params.min_tokens and grammar.constrained(seqs[i])]
        if again:
            rows = [seqs[i] for i in again]
            remasked, why = grammar.mask(apply_logits_processors(logits[again], rows, eos_token_ids, min_tokens=False), rows)  # type: ignore[union-attr]
            processed[again] = remasked
            failed.update({again[j]: reason for j, reason in why.items()})
        for i in empty:  # a row its constraints leave no token at all ends, alone
            if i not in failed and not bool(torch.isfinite(processed[i]).any()):
                failed[i] = "this request's constraints allow no token at all"
    if failed:  # their rows are sampled from zeros, so the sampler's arithmetic never sees them
        processed[list(failed)] = 0.0
    return sampler.sample(processed, [s.params for s in seqs], [s.generator for s in seqs], finite), failed


def eos_ids_from(*candidates: object) -> tuple[int, ...]:
    ids: list[int] = []
    for c in candidates:
        if isinstance(c, int):
            ids.append(c)
        elif isinstance(c, (list, tuple)):
            ids.extend(int(x) for x in c)
    return tuple(dict.fromkeys(ids))


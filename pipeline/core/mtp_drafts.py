"""Speculative drafts from the model's own multi-token-prediction layer (``models.mtp``).

The MTP layer at position i reads the model's final hidden state h_i and token i+1, so it runs right after
the step that computed h_i and chose token i+1: over every row the step keeps (a prefill chunk's rows, a
decode's row, a verified draft's accepted rows), with the token that follows each. That writes its KV at
those positions in the same step as the model's own, before the step commits, so a block is whole (every
layer, the MTP layer's included) when it is published, written through to the tiers or handed off. The
last row of a sequence that sampled then gives its draft for the next step: one token, verified by the
model there (``core.speculation.verify``), so the answer is the model's whatever the draft says.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence as Seq

import torch

from strata.pipeline.core.model_runner import StepInputs
from strata.pipeline.core.sampler import INVALID
from strata.pipeline.core.sequence import SequenceStatus

if TYPE_CHECKING:
    from strata.pipeline.core.model_runner import ModelRunner
    from strata.pipeline.core.scheduler import ScheduledChunk

log = logging.getLogger(__name__)


def step_next_tokens(chunks: Seq[ScheduledChunk], sampling: Seq[ScheduledChunk], tokens: Seq[int],
                     failed: dict[int, str], verified: Seq[tuple[ScheduledChunk, list[int] | None]]
                     ) -> dict[int, list[int]]:
    """For each chunk whose KV the step keeps (by ``id``): the tokens after its kept rows, one per row from
    its start. A prompt chunk's are the prompt's, a sampling chunk ends with its sampled token, a verified
    draft keeps its accepted rows and ends with the model's own token. Failed rows keep nothing."""
    sampled = {id(c): tok for i, (c, tok) in enumerate(zip(sampling, tokens)) if i not in failed and tok != INVALID}
    accepted = {id(c): toks for c, toks in verified if toks is not None}
    out: dict[int, list[int]] = {}
    for c in chunks:
        seq = c.seq
        if seq.status is not SequenceStatus.RUNNING:
            continue
        if c.draft:
            if id(c) in accepted:
                out[id(c)] = accepted[id(c)]
        elif c.samples:
            if id(c) in sampled:
                out[id(c)] = seq.token_ids[c.start + 1 : c.end] + [sampled[id(c)]]
        else:
            out[id(c)] = seq.token_ids[c.start + 1 : c.end + 1]
    return out


class MTPProposer:
    """Drafts one token a step with the MTP layer; the draft is made at the end of the step before."""

    k = 1

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        runner.executor.keep_hidden = True

    def next_limit(self, drafted: int, accepted: int) -> int:
        return self.k

    def propose(self, seq, limit: int) -> list[int]:
        """The draft the last step made for the sequence as it stands now (none after a preemption or when
        the request has no room for it)."""
        draft = seq.mtp_draft
        return [draft[1]] if limit >= 1 and draft is not None and draft[0] == seq.num_tokens else []

    def draft_after(self, executed: Seq[ScheduledChunk], next_tokens: dict[int, list[int]]) -> None:
        """Run the MTP layer over the kept rows of the step that ran ``executed`` (in its row order), and set
        each sampling sequence's draft. A failure here costs drafts, never an answer: it is logged."""
        inputs, rows, tables, drafting = StepInputs(), [], [], []
        offset = 0
        for c in executed:
            following = next_tokens.get(id(c))
            if following:
                n, table = len(following), c.seq.block_table
                rows.extend(range(offset, offset + n))
                inputs.token_ids.extend(following)
                inputs.positions.extend(range(c.start, c.start + n))
                inputs.slots.extend(table.slots(c.start, c.start + n))
                inputs.query_lens.append(n)
                inputs.seq_lens.append(c.start + n)
                inputs.tables.append(table.block_ids)
                inputs.offsets.append(table.first_resident_token)
                inputs.num_spilled.append(table.num_spilled)
                tables.append(table)
                if c.samples:  # its draft is for the sequence once the step's tokens are appended
                    drafting.append((c.seq, len(inputs.token_ids) - 1, c.start + n + 1))
            offset += c.end - c.start
        hidden = self.runner.executor.hidden
        if not rows or hidden is None:
            return
        try:
            out = self.runner.draft(inputs, hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)], tables)
            if drafting:
                last = torch.tensor([r for _, r, _ in drafting], dtype=torch.int64, device=out.device)
                best = self.runner.model.logits(out[last]).argmax(dim=-1).tolist()
                for (seq, _, at), token in zip(drafting, best):
                    seq.mtp_draft = (at, int(token))
        except Exception:
            log.exception("the MTP drafter failed on a step of %d rows; the next step verifies no drafts", len(rows))
        finally:
            self.runner.executor.hidden = None

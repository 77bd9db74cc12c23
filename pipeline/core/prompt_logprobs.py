"""Prompt logprobs: each prompt token's log-probability given the tokens before it (lm-eval's loglikelihood
path, vLLM's ``prompt_logprobs``), read from the rows of the prompt's own forward pass.

A chunk of such a request asks the runner for the logits of every row it computes, not only the last one;
the row at position ``p`` scores prompt token ``p + 1``. The values are recorded on the sequence as the
chunks run (so chunked prefill gives the same numbers as one chunk) and go out with its first token. Rows
a prefix-cache hit would skip have no logits, so such a request never starts from the cache (the scheduler
skips the match; its blocks are still published for others): the answer is the same cold or warm, as in
vLLM. A recompute after preemption records nothing twice.
"""

from __future__ import annotations

import torch

from strata.pipeline.contract.request import PromptLogprob
from strata.pipeline.core.scheduler import ScheduledChunk
from strata.pipeline.core.sequence import Sequence

ROWS_AT_ONCE = 256  # rows normalised together: bounds the fp32 [rows, vocab] temporaries


def wants_prompt_rows(chunk: ScheduledChunk) -> bool:
    """Whether this chunk's every row is scored: its sequence asked for prompt logprobs, has not produced a
    token yet, and still lacks some of them."""
    seq = chunk.seq
    return (seq.params.prompt_logprobs is not None and not chunk.draft and not seq.output_token_ids
            and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1)


def logits_rows(chunk: ScheduledChunk) -> int:
    """Rows of logits the runner returns for a chunk (the order of ``ModelRunner.prepare``)."""
    if chunk.draft:
        return 1 + len(chunk.draft)
    if wants_prompt_rows(chunk):
        return chunk.num_tokens
    return 1 if chunk.samples else 0


def take_prompt_rows(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[Sequence]]:
    """Record the prompt logprobs of the chunks that asked for every row, and return the logits as the rest
    of the step reads them (one row per sampling chunk, a draft's rows kept), with the sequences whose
    prompt rows held non-finite values (they fail; their rows are dropped)."""
    wanting = [wants_prompt_rows(c) for c in chunks]
    if not any(wanting):
        return logits, []
    keep: list[int] = []
    bad: list[Sequence] = []
    row = 0
    for chunk, wants in zip(chunks, wanting):
        n = chunk.num_tokens if wants else logits_rows(chunk)
        if wants:
            if not record(chunk.seq, chunk.start, logits[row : row + n]):
                bad.append(chunk.seq)  # its rows leave the step with it
            elif chunk.samples:
                keep.append(row + n - 1)
        else:
            keep.extend(range(row, row + n))
        row += n
    return logits[keep], bad


def record(seq: Sequence, start: int, rows: torch.Tensor) -> bool:
    """Append the logprobs the rows of positions ``start ..`` give the prompt tokens after them (those not
    recorded yet); False if a row holds NaN or inf."""
    last = seq.num_prompt_tokens - 1  # the row of the last prompt token scores no prompt token
    first = len(seq.prompt_logprobs)  # the next position whose row is wanted
    if start > first:
        raise RuntimeError(f"prompt logprobs of positions {first}..{start - 1} were skipped")
    lo, hi = first, min(start + len(rows), last)
    if lo >= hi:
        return True
    part = rows[lo - start : hi - start]
    if not bool(torch.isfinite(part).all()):
        return False
    targets = torch.tensor(seq.token_ids[lo + 1 : hi + 1], dtype=torch.int64, device=rows.device)
    k = seq.params.prompt_logprobs or 0
    for s in range(0, hi - lo, ROWS_AT_ONCE):
        lp = torch.log_softmax(part[s : s + ROWS_AT_ONCE].float(), dim=-1)
        chosen = lp.gather(1, targets[s : s + ROWS_AT_ONCE, None]).squeeze(1)
        ranks = (lp > chosen[:, None]).sum(dim=1) + 1
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (None, None)
        for j, (value, rank) in enumerate(zip(chosen.tolist(), ranks.tolist())):
            top = list(zip(top_ids[j].tolist(), top_vals[j].tolist())) if k else []
            seq.prompt_logprobs.append(PromptLogprob(value, rank, top))
    return True

"""What a request asks to change in its logits before sampling: penalties, biases and a minimum length.

Applied in the batched step to the rows that ask (every other row is untouched, and a batch with no such
row costs one Python check), in this order, as vLLM does:

* ``repetition_penalty`` (transformers' and vLLM's): every token the sequence holds, prompt and output,
  has a positive logit divided by it and a negative one multiplied by it;
* ``frequency_penalty`` and ``presence_penalty`` (OpenAI's): an output token's logit loses
  ``frequency * count + presence`` (its count in the output so far);
* ``logit_bias`` (OpenAI's): token id -> a value added to its logit;
* ``min_tokens`` (vLLM's): until that many tokens are out, the end-of-sequence and stop tokens are masked.

Counts are kept per sequence and updated with the tokens appended since the last step, so a step costs
O(new tokens + vocab) per penalised row, never O(context).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence as Seq

import torch

from strata.pipeline.contract.sampling_params import SamplingParams


class TokenCounts:
    """One sequence's token counts for its penalties: output tokens and every token seen (prompt too)."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.output = torch.zeros(vocab, dtype=torch.int32, device=device)
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.consumed = 0  # tokens of the sequence already counted

    def update(self, token_ids: list[int], num_prompt: int) -> None:
        new = token_ids[self.consumed :]
        if not new:
            return
        ids = torch.tensor(new, dtype=torch.int64, device=self.output.device)
        self.seen[ids] = True
        out_from = max(0, num_prompt - self.consumed)
        if out_from < len(new):
            self.output.index_add_(0, ids[out_from:], torch.ones(len(new) - out_from, dtype=torch.int32,
                                                                  device=self.output.device))
        self.consumed = len(token_ids)


def needs_processing(params: SamplingParams) -> bool:
    return bool(params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
                or params.logit_bias or params.min_tokens)


def apply_logits_processors(logits: torch.Tensor, seqs: Seq, eos_token_ids: Collection[int],
                            min_tokens: bool = True) -> torch.Tensor:
    """``logits`` [rows, vocab] of the sampling sequences ``seqs`` (objects with ``params``, ``token_ids``,
    ``num_prompt_tokens`` and a ``token_counts`` slot), processed for the rows that ask; the same tensor
    when none does. ``min_tokens=False`` leaves that one out (a grammar that allows only stop tokens)."""
    rows = [i for i, s in enumerate(seqs) if needs_processing(s.params)]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        seq, p = seqs[i], seqs[i].params
        row = logits[i]
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            counts = seq.token_counts
            if counts is None or counts.output.shape[0] != vocab:
                counts = seq.token_counts = TokenCounts(vocab, logits.device)
            counts.update(seq.token_ids, seq.num_prompt_tokens)
            if p.repetition_penalty != 1.0:
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row = torch.where(counts.seen, penalised, row)
            if p.frequency_penalty or p.presence_penalty:
                out = counts.output.to(row.dtype)
                row = row - p.frequency_penalty * out - p.presence_penalty * (out > 0).to(row.dtype)
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.int64, device=row.device)
            bias = torch.tensor([v for t, v in p.logit_bias.items() if t < vocab], dtype=row.dtype, device=row.device)
            row = row.index_add(0, ids, bias)
        if min_tokens and p.min_tokens and len(seq.token_ids) - seq.num_prompt_tokens < p.min_tokens:
            banned = [t for t in (*(() if p.ignore_eos else eos_token_ids), *p.stop_token_ids) if t < vocab]
            if banned:
                row = row.index_fill(0, torch.tensor(banned, dtype=torch.int64, device=row.device), float("-inf"))
        logits[i] = row
    return logits

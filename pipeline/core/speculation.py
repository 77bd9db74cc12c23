"""Speculative decoding by prompt lookup: draft from the sequence's own tokens, verify in one forward.

A decode step normally computes one token per sequence, and on a CPU (or any batch too small to fill
the device) that step is bound by reading the weights, not by the arithmetic. Verifying k drafted
tokens costs about the same read, so every accepted draft is a token for free. The drafts here come
from prompt lookup (vLLM's ``ngram``): the tokens that followed the latest earlier occurrence of the
sequence's last n tokens. No draft model, no extra weights; it pays off where an answer repeats its
context (edits of given code, summaries, extraction) and costs one wider step where it does not.

Verification is exact. Greedy rows keep drafts while they equal the target's argmax, then take the
target's own token, so greedy output is the same with speculation on or off. Sampled rows use
rejection sampling against the deterministic draft: draft ``d`` is accepted with probability
``p(d)``, and on rejection the token is drawn from ``p`` with ``d`` removed; every token then has
exactly the target's distribution ``p`` (temperature, top-k and top-p applied as the sampler does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from strata.pipeline.contract.config import SpeculativeConfig
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.sampler import draw_from, target_probs, uniform

SEARCH_WINDOW = 16384  # tokens searched for a match (the tail of the sequence): bounds a step's work at 1M tokens


class NgramProposer:
    """Drafts up to ``num_speculative_tokens`` tokens by matching the sequence's last n tokens earlier on."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_max = int(config.prompt_lookup_max or 5)
        self.n_min = int(config.prompt_lookup_min or self.n_max)

    def next_limit(self, drafted: int, accepted: int) -> int:
        """How many tokens a sequence may draft next, after ``accepted`` of its ``drafted`` held: all k
        again after a fully accepted draft, one past what held after a rejection. Where lookups
        keep missing, the verifying step stays two rows wide, which costs about what one row does (the
        step reads its weights once either way), instead of k + 1."""
        if accepted == drafted:
            return self.k
        return accepted + 1

    def propose(self, token_ids: Seq[int], limit: int) -> list[int]:
        """At most ``min(k, limit)`` tokens: what followed the latest earlier match of the longest suffix
        n-gram (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``); empty when nothing matches."""
        k = min(self.k, limit)
        if k <= 0 or len(token_ids) <= self.n_min:
            return []
        tail = np.asarray(token_ids[-SEARCH_WINDOW:], dtype=np.int64)
        length = len(tail)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            # windows start at 0 .. length-1-n, so each match has at least one token after it and the
            # suffix never matches itself
            windows = sliding_window_view(tail[: length - 1], n)
            hits = np.flatnonzero((windows == tail[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tail[start : start + k].tolist()
        return []


@dataclass
class SpeculationStats:
    """Monotonic totals for ``/metrics``: acceptance rate = accepted / drafted; tokens per verifying
    step = (accepted + verifications) / verifications."""

    verifications: int = 0  # sequence-steps that verified a draft
    drafted: int = 0
    accepted: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"verifications": self.verifications, "drafted": self.drafted, "accepted": self.accepted}


def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """The tokens a verifying step adds: the accepted prefix of ``draft``, then one token of the target's
    own (the correction at the first rejection, or the bonus token after a fully accepted draft).
    ``logits`` [len(draft) + 1, vocab]: row i is the target's prediction after the sequence plus
    ``draft[:i]``. Consumes one uniform per tested draft, one more on a rejection or for the bonus."""
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(draft) and best[accepted] == draft[accepted]:
            accepted += 1
        return draft[:accepted] + [best[accepted]]
    probs = target_probs(logits, [params] * logits.shape[0])
    out: list[int] = []
    for i, token in enumerate(draft):
        if uniform(generator) < float(probs[i, token]):
            out.append(token)
            continue
        residual = probs[i].clone()
        residual[token] = 0.0
        if not bool(residual.any()):  # the draft held all the mass but float rounding: nothing else to draw
            return out + [token]
        return out + [draw_from(residual, generator)]
    return out + [draw_from(probs[len(draft)], generator)]

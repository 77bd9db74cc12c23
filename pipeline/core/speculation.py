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
from typing import Any, Sequence as Seq

import numpy as np
import torch

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

    def propose(self, seq: Any, limit: int) -> list[int]:
        """At most ``min(k, limit)`` tokens: what followed the latest earlier match of the longest suffix
        n-gram (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``); empty when nothing matches.
        O(window) a step: one comparison against the last token finds the candidates, and only they are
        extended backwards; the sequence's tokens are kept as an array that grows with it."""
        k = min(self.k, limit)
        if k <= 0 or len(seq.token_ids) <= self.n_min:
            return []
        if seq.lookup_ids is None:
            seq.lookup_ids = TokenArray()
        ids = seq.lookup_ids.sync(seq.token_ids)[-SEARCH_WINDOW:]
        ends = np.flatnonzero(ids[:-1] == ids[-1])  # where an earlier match would end: never the suffix itself
        if not ends.size:
            return []
        back = np.arange(self.n_max)
        at = ends[:, None] - back[None, :]  # candidate position j tokens before each end
        same = (at >= 0) & (ids[np.maximum(at, 0)] == ids[len(ids) - 1 - back][None, :])
        if len(ids) - 1 < self.n_max:  # the suffix itself is shorter than n_max
            same[:, len(ids) - 1 :] = False
        lengths = np.cumprod(same, axis=1).sum(axis=1)  # matched suffix length at each candidate, <= n_max
        best = int(lengths.max())
        if best < self.n_min:
            return []
        start = int(ends[np.flatnonzero(lengths == best)[-1]]) + 1
        return ids[start : start + k].tolist()


class TokenArray:
    """A sequence's token ids as a growing int64 array (they are only ever appended), so a lookup does not
    convert the whole list every step."""

    def __init__(self) -> None:
        self.data = np.empty(256, dtype=np.int64)
        self.size = 0

    def sync(self, token_ids: Seq[int]) -> np.ndarray:
        """The ids so far (a view), after appending those added since the last call."""
        n = len(token_ids)
        if n > len(self.data):
            grown = np.empty(max(n, 2 * len(self.data)), dtype=np.int64)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        if n > self.size:
            self.data[self.size : n] = token_ids[self.size : n]
            self.size = n
        return self.data[:n]


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

"""Token sampling and stop detection.

Sampling is inverse-CDF driven by exactly one uniform draw per row from that request's own CPU generator.
That keeps a seeded request reproducible regardless of which other requests share its batch, and
regardless of the device the logits live on. Rows with a top-k or top-p filter draw from the filtered,
sorted distribution; a batch whose rows have only a temperature draws in vocabulary order, with no sort:
sorting 16 rows of a 49K vocabulary took 24 ms of a 64 ms step (the step took 40 ms greedy), and an
OpenAI client that sets no filter is the common case.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from strata.pipeline.contract.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


def make_generator(seed: int | None) -> torch.Generator | None:
    """A per-request CPU generator; None (use torch's default generator) when the request has no seed."""
    if seed is None:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


INVALID = -1  # the token of a row whose logits are not finite (that sequence fails, the batch goes on)


@dataclass
class Logprobs:
    """Log-probabilities (of the model's distribution, before temperature and filters) of the chosen
    tokens and of each row's most likely tokens, for the rows that asked."""

    chosen: list[float | None]
    top: list[list[tuple[int, float]] | None]


class Sampler:
    """Samples one token per row of a logits batch, each row with its own params and generator."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        finite: torch.Tensor | None = None,
    ) -> list[int]:
        """One token id per row of `logits` [B, V]; :data:`INVALID` for a row with NaN or inf logits.
        ``finite``: which rows are valid, when `logits` were processed from the model's (a request's
        masked tokens are -inf by design; only the model's own non-finite values make a row invalid)."""
        if finite is None:
            finite = row_is_finite(logits) if logits.numel() else None
        if finite is None or bool(finite.all()):
            return self._sample(logits, params, generators)
        # A broken row (NaN or inf from its own inputs) is sampled from zeros and marked invalid, so
        # the sampler's arithmetic never sees it and the other rows are untouched.
        safe = torch.where(finite.unsqueeze(1), logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
        tokens = self._sample(safe, params, generators)
        return [t if ok else INVALID for t, ok in zip(tokens, finite.tolist())]

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: list[int], params: Sequence[SamplingParams]) -> Logprobs | None:
        """Logprobs for the rows whose params ask for them (None when no row does)."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None and tokens[i] != INVALID]
        if not rows:
            return None
        chosen: list[float | None] = [None] * len(tokens)
        top: list[list[tuple[int, float]] | None] = [None] * len(tokens)
        index = torch.tensor(rows, device=logits.device)
        logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        k = max(params[i].logprobs or 0 for i in rows)
        top_vals, top_ids = logp.topk(max(1, k), dim=-1)
        picked = logp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=logits.device)).squeeze(1).tolist()
        vals, ids = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            chosen[i] = picked[j]
            n = params[i].logprobs or 0
            top[i] = list(zip(ids[j][:n], vals[j][:n]))
        return Logprobs(chosen, top)

    def _sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        if logits.ndim != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"got {batch} logit rows but {len(params)} params and {len(generators)} generators"
            )
        if batch == 0:
            return []
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy_rows) == batch:
            return logits.argmax(dim=-1).tolist()

        tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            tokens[rows] = logits.index_select(0, rows).argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        rows = torch.tensor(sampled_rows, device=logits.device)
        tokens[rows] = _sample_rows(
            logits.index_select(0, rows),
            [params[i] for i in sampled_rows],
            [generators[i] for i in sampled_rows],
        )
        return tokens.tolist()


def _sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Temperature, top-k, top-p, then one inverse-CDF draw per row; all row-wise, so rows never interact."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    scaled = logits.float() / temperature.unsqueeze(1)
    uniforms = torch.tensor([uniform(g) for g in generators], dtype=torch.float32, device=device)
    if not _filters(params, logits.shape[-1]):  # temperature only: the vocabulary's order, no sort
        return _inverse_cdf(torch.softmax(scaled, dim=-1), uniforms)
    # Stable descending sort: equal logits keep ascending token order, like argmax's tie-break.
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = _mask_top_p(torch.softmax(_mask_top_k(sorted_logits, params), dim=-1), params)
    return sorted_ids.gather(1, _inverse_cdf(probs, uniforms).unsqueeze(1)).squeeze(1)


def _filters(params: Sequence[SamplingParams], vocab: int) -> bool:
    """Whether any row has a top-k or top-p filter that removes tokens."""
    return any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the position where the cumulative mass first exceeds that row's uniform share of it."""
    cumulative = probs.cumsum(dim=-1)
    targets = uniforms.unsqueeze(1) * cumulative[:, -1:]
    positions = torch.searchsorted(cumulative, targets, right=True).squeeze(1)
    # Rounding can push the target to the total mass; fall back to the last position that has any.
    has_mass = probs > 0
    last_kept = probs.shape[-1] - 1 - has_mass.flip(-1).to(torch.uint8).argmax(dim=-1)
    return torch.minimum(positions, last_kept)


def _mask_top_k(sorted_logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Drop everything past the k-th sorted position (k=0 or k>=vocab keeps all)."""
    vocab = sorted_logits.shape[-1]
    if not any(0 < p.top_k < vocab for p in params):
        return sorted_logits
    k = torch.tensor(
        [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=sorted_logits.device
    )
    positions = torch.arange(vocab, device=sorted_logits.device)
    return sorted_logits.masked_fill(positions.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))


def _mask_top_p(sorted_probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Keep the smallest prefix whose mass reaches top_p: a token survives if the mass before it is < top_p."""
    if not any(p.top_p < 1.0 for p in params):
        return sorted_probs
    top_p = torch.tensor(
        [p.top_p if p.top_p < 1.0 else float("inf") for p in params],
        dtype=sorted_probs.dtype,
        device=sorted_probs.device,
    )
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False  # the most likely token always survives
    return sorted_probs.masked_fill(drop, 0.0)


def uniform(generator: torch.Generator | None) -> float:
    """One U[0, 1) draw; consuming exactly one per step makes a seeded stream independent of batching."""
    return torch.rand(1, generator=generator, dtype=torch.float64).item()


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[B, V] probabilities (vocab order) that :meth:`Sampler.sample` draws each row from: temperature,
    top-k, then top-p, as ``_sample_rows`` applies them (what speculative verification must match)."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=logits.device)
    if not _filters(params, logits.shape[-1]):
        return torch.softmax(logits.float() / temperature.unsqueeze(1), dim=-1)
    sorted_logits, sorted_ids = torch.sort(logits.float() / temperature.unsqueeze(1), dim=-1, descending=True,
                                           stable=True)
    probs = _mask_top_p(torch.softmax(_mask_top_k(sorted_logits, params), dim=-1), params)
    out = torch.zeros_like(probs).scatter_(1, sorted_ids, probs)
    return out / out.sum(dim=-1, keepdim=True)


def draw_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from an unnormalized [V] distribution by inverse CDF (one uniform)."""
    cumulative = probs.double().cumsum(dim=0)
    position = int(torch.searchsorted(cumulative, uniform(generator) * cumulative[-1], right=True))
    return min(position, int(probs.nonzero().max()))


@dataclass(frozen=True)
class StopResult:
    """Outcome of a stop check: why generation finished (or None) and the text to report."""

    finish_reason: str | None  # "stop", "length" or None (keep going)
    text: str  # output text, truncated before the stop string when one matched
    stop_reason: int | str | None = None  # matched stop token id / stop string; None for eos or length


def row_is_finite(logits: torch.Tensor) -> torch.Tensor:
    """Per row, whether all its values are finite: a NaN or an inf anywhere makes the row's float32 sum one, so
    this is one reduction (0.08 ms for 32 x 49K logits here, against 2.6 ms for ``isfinite(...).all``)."""
    return torch.isfinite(logits.sum(dim=-1, dtype=torch.float32))


def check_stop(
    output_token_ids: Sequence[int],
    eos_token_ids: Collection[int],
    params: SamplingParams,
    text: str,
    prev_text_len: int = 0,
    stop_tokens: bool = True,
) -> StopResult:
    """Decide whether a request is finished after appending its newest token.

    `output_token_ids` are all generated ids, the last one being the new token; `text` is the detokenized
    output so far. `prev_text_len` is how long `text` was before this step: only the tail that could contain
    a new match is searched, keeping the per-step cost independent of output length.
    Precedence: eos / stop token, then stop string, then max_tokens. ``stop_tokens=False``: the new token is
    content even if it is a stop token (a grammar took it as such).
    """
    if not output_token_ids:
        return StopResult(None, text)
    new_token = output_token_ids[-1]
    if stop_tokens and new_token in params.stop_token_ids:
        return StopResult(FINISH_STOP, text, new_token)
    if stop_tokens and not params.ignore_eos and new_token in eos_token_ids:
        return StopResult(FINISH_STOP, text)
    match = _find_stop_string(text, params.stop, prev_text_len)
    if match is not None:
        index, stop = match
        return StopResult(FINISH_STOP, text[:index], stop)
    if len(output_token_ids) >= params.max_tokens:
        return StopResult(FINISH_LENGTH, text)
    return StopResult(None, text)


def _find_stop_string(text: str, stops: Sequence[str], prev_text_len: int) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string that ends in the new part of `text`."""
    best: tuple[int, str] | None = None
    for stop in stops:
        # A match completed by this step starts at most len(stop)-1 chars before the new text.
        start = max(0, min(prev_text_len, len(text)) - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best

"""A prompt's logprobs in the two shapes clients read: OpenAI's ``echo`` on ``/v1/completions`` (the prompt's
tokens before the answer's in ``logprobs``, the first with ``None``, which is what lm-eval's loglikelihood
path sums) and vLLM's ``prompt_logprobs`` (per prompt token, ``None`` for the first, then a map of token
ids to ``{logprob, rank, decoded_token}``: the prompt token and the most likely ones at its place).

The engine computes them from the prompt's own forward (``pipeline.core.prompt_logprobs``) and sends them
on the request's first event.
"""

from __future__ import annotations

from typing import Any, Callable

from strata.pipeline.contract.request import PromptLogprob, TokenEvent

Decode = Callable[[list[int]], str]


def prompt_logprobs_of(events: list[TokenEvent]) -> list[PromptLogprob]:
    """The prompt logprobs a request's events carry (on its first event)."""
    return next((ev.prompt_logprobs for ev in events if ev.prompt_logprobs is not None), [])


def token_texts(decode: Decode) -> Callable[[int], str]:
    """Each token id's text, decoded once per response: a long prompt's top maps repeat the same few ids, and
    a tokenizer call per entry would cost seconds on a 32K-token prompt."""
    cache: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in cache:
            cache[token] = decode([token])
        return cache[token]

    return text


def vllm_prompt_logprobs(prompt_ids: list[int], logprobs: list[PromptLogprob], decode: Decode) -> list[Any]:
    """vLLM's ``prompt_logprobs``: ``[None, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]``."""
    text = token_texts(decode)
    out: list[Any] = [None]
    for token, lp in zip(prompt_ids[1:], logprobs):
        entry = {str(t): {"logprob": v, "rank": i + 1, "decoded_token": text(t)} for i, (t, v) in enumerate(lp.top)}
        entry[str(token)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(token)}
        out.append(entry)
    return out


def echo_logprobs(prompt_ids: list[int], logprobs: list[PromptLogprob], decode: Decode) -> dict[str, Any]:
    """OpenAI's completion ``logprobs`` of the echoed prompt: its tokens, their logprobs (``None`` first),
    their top maps (the prompt token included, as vLLM gives them) and their offsets in the echoed text."""
    one = token_texts(decode)
    tokens, values, tops, offsets = [], [], [], []
    offset = 0
    for i, token in enumerate(prompt_ids):
        text = one(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if i == 0 or i - 1 >= len(logprobs):
            values.append(None)
            tops.append(None)
            continue
        lp = logprobs[i - 1]
        values.append(lp.logprob)
        top = {one(t): v for t, v in lp.top}
        top[text] = lp.logprob
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def joined(prompt: dict[str, Any], answer: dict[str, Any] | None) -> dict[str, Any]:
    """The echoed prompt's logprobs followed by the answer's (whose offsets already count the echoed text)."""
    if answer is None:
        return prompt
    return {key: prompt[key] + answer[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

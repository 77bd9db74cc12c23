"""OpenAI response objects (whole and streamed) built from Strata token events."""

from __future__ import annotations

import json
from typing import Any

from strata.pipeline.core.sampler import FINISH_LENGTH, FINISH_STOP


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event line (``data: [DONE]`` for the terminator)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


class ContentChunks:
    """The SSE line of each text delta of one streamed response. The JSON around the text is the same
    for every token of a response, so it is formatted once: the same bytes as ``sse(chat_chunk(...))``
    at a fraction of the cost per token."""

    def __init__(self, rid: str, model: str, created: int, chat: bool) -> None:
        marker = "\x00"
        base = chat_chunk(rid, model, created, {"content": marker}, None) if chat else \
            completion_chunk(rid, model, created, marker, None)
        head, tail = sse(base).split(json.dumps(marker))
        self.head, self.tail = head, tail

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text) + self.tail


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(rid: str, model: str, created: int, obj: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}


def chat_completion(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                    usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None, "annotations": []},
                     "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage,
    }


def completion(rid: str, model: str, created: int, text: str, finish_reason: str | None,
               usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage,
    }


# The finish reasons the OpenAI API defines; no other value may reach a client.
OPENAI_FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})

# Strata's reasons for a request that *completed*, in OpenAI's words. "eos" is the name older
# replicas gave an end-of-sequence stop (events may cross versions during a rolling update).
COMPLETED_FINISH_REASONS: dict[str, str] = {FINISH_STOP: "stop", "eos": "stop", FINISH_LENGTH: "length"}


class IncompleteFinish(ValueError):
    """A finish reason of a request that did not complete (``abort``, ``error``, or one unknown here)."""


def is_completed(reason: str | None) -> bool:
    """Whether ``reason`` ends a request that completed (its answer may be shown as finished)."""
    return reason in COMPLETED_FINISH_REASONS


def openai_finish_reason(reason: str | None) -> str | None:
    """Strata's reason of a completed request in OpenAI's vocabulary (None while it runs on).

    Any other reason raises :class:`IncompleteFinish`: ``abort`` (the sequence was cancelled: its
    client went away, or its stage failed or shut down) and ``error`` mean the answer is cut short.
    Calling it ``stop`` would pass a truncated answer off as complete, and ``abort`` is no OpenAI
    value (clients that validate it fail), so such a request takes the error path instead (see
    ``responder``): a JSON error before the first byte, an in-band error event once streaming.
    """
    if reason is None:
        return None
    try:
        return COMPLETED_FINISH_REASONS[reason]
    except KeyError:
        raise IncompleteFinish(f"finish reason {reason!r} does not end a completed request") from None

"""OpenAI response objects (whole and streamed) built from Strata token events."""

from __future__ import annotations

import json
from typing import Any


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
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
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


def openai_finish_reason(reason: str | None) -> str | None:
    """Strata's reasons (eos, stop, length, abort) in OpenAI's vocabulary."""
    return {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}.get(reason or "", reason)

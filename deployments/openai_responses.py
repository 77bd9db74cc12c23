"""OpenAI response objects (whole and streamed) built from Strata token events."""

from __future__ import annotations

import json
from typing import Any


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event line (``data: [DONE]`` for the terminator)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


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

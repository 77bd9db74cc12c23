"""Reading a request body safely: bounded in size before it is parsed, parsed without crashing on hostile
JSON, and checked for text the tokenizer cannot take. Every refusal is an :class:`APIError` (4xx).

A large body (over :data:`OFF_LOOP_BYTES`) is decoded and checked on a worker thread, and so is whatever
else the route does with it (:func:`off_loop`: the schema check): the event loop that serves every other
stream only waits for the bytes."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Callable, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from strata.deployments.openai.protocol import APIError

T = TypeVar("T")
OFF_LOOP_BYTES = 256 * 1024  # a body larger than this is parsed off the event loop (a thread hop costs ~50 us)


async def read_json(request: Request, max_bytes: int, timeout_s: float,
                    precheck: Callable[[Any], None] | None = None) -> Any:
    """The decoded JSON body. A body over ``max_bytes`` is a 413 before it is buffered whole (the
    Content-Length header is checked first, then the stream is read only up to the limit). A body
    that has not arrived whole within ``timeout_s`` is a 408: a client that sends headers and then
    stalls (or trickles bytes) holds a connection for that long at most. ``precheck`` sees the decoded body
    before it is walked (a route's cheap refusals: a prompt that can never fit)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise APIError(413, f"the request body is larger than {max_bytes} bytes", code="request_too_large")
    try:
        raw = await asyncio.wait_for(_read_body(request, max_bytes), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout") from None
    except ClientDisconnect:  # nobody reads the answer; counted as 499 like an abandoned stream, never a 500
        raise APIError(499, "the client closed the connection before its body arrived",
                       code="client_closed_request") from None
    request.state.body_bytes = len(raw)
    return await off_loop(request, _decode, raw, precheck)


async def off_loop(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, on a worker thread when the request's body was large (see the module)."""
    if getattr(request.state, "body_bytes", 0) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a lone UTF-16 surrogate can only come from one


def _decode(raw: bytes, precheck: Callable[[Any], None] | None = None) -> Any:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise APIError(400, "request body is nested too deeply") from exc
    if precheck is not None:
        precheck(body)
    # raw UTF-8 cannot hold a surrogate (json.loads refuses it): only a \ud800-\udfff escape can make one
    check_text(body, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


async def _read_body(request: Request, max_bytes: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body is larger than {max_bytes} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def check_text(value: Any, path: str = "", depth: int = 0, strings: bool = True) -> None:
    """Refuse strings that are not valid Unicode (lone UTF-16 surrogates, which JSON's \\ud800 escapes
    can produce and which no tokenizer can encode) and structures nested beyond reason (``strings=False``:
    the nesting alone, for a body with no surrogate escape)."""
    if depth > 64:
        raise APIError(400, "request body is nested too deeply", param=path or None)
    if isinstance(value, str) and strings:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(400, "text contains an unpaired UTF-16 surrogate (invalid Unicode)", param=path or None) from exc
    elif isinstance(value, dict):
        for key, item in value.items():
            if strings:
                check_text(key, path, depth + 1)
            if strings or isinstance(item, (dict, list)):
                check_text(item, f"{path}.{key}" if path else str(key), depth + 1, strings)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if strings or isinstance(item, (dict, list)):
                check_text(item, f"{path}.{i}", depth + 1, strings)

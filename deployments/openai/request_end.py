"""What must happen when an HTTP request ends, however it ends: run by the ASGI call that owns it.

A streamed response is an async generator that Starlette iterates; when the client goes away (before the
first byte or after), the iterating task is cancelled and the generator is left suspended, to be closed
whenever the garbage collector finalizes it, or never. Counting admitted requests, or aborting the
engine's work, in that generator's ``finally`` therefore leaked slots under client churn (a server that
filled up with ghosts answered 429 to everyone). Here the work that belongs to a request's end is
registered with :func:`at_request_end` and run by :class:`RequestEndMiddleware` in the ``finally`` of the
request's ASGI call, which ends exactly once: finished, failed, timed out or cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, AsyncIterator, Callable

log = logging.getLogger(__name__)
_ENDS: ContextVar[list[Callable[[], Any]] | None] = ContextVar("strata_request_end", default=None)
_closing: set[asyncio.Task] = set()  # cleanups still running after their request ended (held: not collected)


def at_request_end(fn: Callable[[], Any]) -> bool:
    """Run ``fn`` (a function, or one returning an awaitable) when the current HTTP request ends; False
    outside a request the middleware owns (then the caller must see to it itself)."""
    ends = _ENDS.get()
    if ends is None:
        return False
    ends.append(fn)
    return True


@asynccontextmanager
async def request_scope() -> AsyncIterator[None]:
    """One request's lifetime: the work registered inside it runs (newest first) when it is left, however.
    Awaitable work is left to run on its own task, so a cancelled request still gets it done."""
    ends: list[Callable[[], Any]] = []
    token = _ENDS.set(ends)
    try:
        yield
    finally:
        _ENDS.reset(token)
        for fn in reversed(ends):
            try:
                result = fn()
            except Exception:  # noqa: BLE001 - one cleanup's failure must not skip the others
                log.exception("a request's end-of-request work failed")
                continue
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                _closing.add(task)
                task.add_done_callback(_closing.discard)


class RequestEndMiddleware:
    """Pure ASGI middleware: every HTTP request's call runs in a :func:`request_scope`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        async with request_scope():
            await self.app(scope, receive, send)

"""The end of an HTTP request's work (``deployments.openai.request_end``): what a request registers runs once when
its scope is left, newest first, whether it finished, raised or was cancelled mid-await, and a stream's
generator left suspended at a ``yield`` (as Starlette leaves it when the client goes) is closed by it
rather than whenever the garbage collector gets to it."""

from __future__ import annotations

import asyncio

import pytest

from strata.deployments.openai.admission import Admission
from strata.deployments.openai.request_end import at_request_end, request_scope

pytestmark = pytest.mark.unit


def test_end_work_runs_once_however_the_request_ends() -> None:
    async def go() -> list[str]:
        done: list[str] = []
        async with request_scope():
            at_request_end(lambda: done.append("first"))
            at_request_end(lambda: done.append("second"))
        with pytest.raises(RuntimeError):
            async with request_scope():
                at_request_end(lambda: done.append("raised"))
                raise RuntimeError("the handler failed")

        async def handler() -> None:
            async with request_scope():
                at_request_end(lambda: done.append("cancelled"))
                await asyncio.sleep(30)

        task = asyncio.ensure_future(handler())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return done

    assert asyncio.run(go()) == ["second", "first", "raised", "cancelled"]
    assert not at_request_end(lambda: None)  # outside a request: the caller is told


def test_a_stream_left_at_a_yield_is_closed_and_its_slot_returned() -> None:
    async def go() -> tuple[bool, int]:
        closed = asyncio.Event()
        admission = Admission(2)

        async def body():
            try:
                while True:
                    yield "chunk"
            finally:
                closed.set()

        stream = body()
        async with request_scope():
            assert admission.admit()
            at_request_end(stream.aclose)
            assert await stream.__anext__() == "chunk"  # suspended at its yield, as a departed client leaves it
        await asyncio.wait_for(closed.wait(), 5)
        return closed.is_set(), admission.held

    assert asyncio.run(go()) == (True, 0)


def test_admission_refuses_past_its_limit_and_needs_the_middleware() -> None:
    async def go() -> None:
        admission = Admission(1)
        async with request_scope():
            assert admission.admit()
            assert not admission.admit()
        assert admission.held == 0
        with pytest.raises(RuntimeError, match="RequestEndMiddleware"):
            admission.admit()

    asyncio.run(go())

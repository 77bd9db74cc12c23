"""What a client sees when a stage below the ingress fails, with fake stage handles (no Ray cluster).

The disaggregated request flow (Prefill -> Decode) and the Responder are the real ones; only the
deployment handles are stand-ins that raise what Ray raises: ``BackPressureError`` from a full
stage, an actor error whose text carries internals, or a decode stream that dies mid-way.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest
from ray.serve.exceptions import BackPressureError

from strata.deployments.openai.protocol import APIError, ChatCompletionRequest, parse_request
from strata.deployments.openai.request_flow import StageFlow
from strata.deployments.openai.admission import Admission
from strata.deployments.openai.request_end import request_scope
from strata.deployments.openai.responder import Responder
from strata.pipeline.contract.handoff import Handoff, SequenceState
from strata.pipeline.contract.request import Request, TokenEvent, pack_events
from strata.pipeline.contract.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

INTERNALS = "ActorDiedError: actor 6f1e2d3c4b5a pid=48213 ip=10.1.2.3 died at /tmp/ray/session_x/worker.py"


class _Call:
    """``handle.method`` of a fake deployment handle: ``.remote(...)`` runs ``fn``."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class _Stream:
    """What ``decode.options(stream=True).generate.remote()`` returns: async frames, cancellable."""

    def __init__(self, frames: list[bytes], then: BaseException | None) -> None:
        self.frames, self.then, self.cancelled = frames, then, False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[bytes]:
        for f in self.frames:
            yield f
        if self.then is not None:
            raise self.then

    def cancel(self) -> None:
        self.cancelled = True


class FakePrefill:
    def __init__(self, error: BaseException | None = None, first_token: int = 7) -> None:
        async def prefill(msg: bytes) -> tuple[bytes, bytes]:
            if error is not None:
                raise error
            req = Request.from_msgpack(msg)
            first = TokenEvent(req.request_id, first_token, "a")
            state = SequenceState(req.request_id, req.prompt_token_ids + [first_token], req.num_prompt_tokens, req.params)
            self.handoff = Handoff(state, first, b"handle").to_msgpack()
            return pack_events([first]), self.handoff

        self.handoff = b""
        self.prefill = _Call(prefill)

    def options(self, **_: Any) -> "FakePrefill":
        return self


class FakeDecode:
    def __init__(self, frames: list[bytes], then: BaseException | None = None) -> None:
        self.stream = _Stream(frames, then)
        self.received: list[bytes] = []
        self.generate = _Call(lambda msg: (self.received.append(msg), self.stream)[1])

    def options(self, **_: Any) -> "FakeDecode":
        return self


_INTAKE = SimpleNamespace(config=SimpleNamespace(block_size=16))  # all StageFlow reads of its intake here


def _run(prefill: FakePrefill, decode: FakeDecode, stream: bool) -> tuple[int, dict[str, str], str]:
    """One chat request through StageFlow + Responder: (status, headers, body text)."""
    async def go() -> tuple[int, dict[str, str], str]:
        flow = StageFlow(intake=_INTAKE, preprocess=None, encode=None, prefill=prefill, decode=decode)  # type: ignore[arg-type]
        responder = Responder("m", lambda ids: "x" * len(ids), retry_after_s=2.0, deadline_s=30.0)
        req = parse_request(ChatCompletionRequest, {"model": "m", "stream": stream,
                                                    "messages": [{"role": "user", "content": "hi"}]})
        prepared = Request("chatcmpl-1", [1, 2, 3], SamplingParams(max_tokens=4))
        events = flow.events(prepared)
        admission = Admission(4)
        async with request_scope():  # what RequestEndMiddleware gives every HTTP request
            assert admission.admit()
            if stream:
                resp = await responder.stream(req, prepared, events, True, time.perf_counter())
            else:
                resp = await responder.whole(req, prepared, events, True, time.perf_counter())
            if hasattr(resp, "body_iterator"):
                body = "".join([c if isinstance(c, str) else c.decode() async for c in resp.body_iterator])
            else:
                body = resp.body.decode()
        assert admission.held == 0  # the request's slot came back as it ended
        return resp.status_code, dict(resp.headers), body

    return asyncio.run(go())


def _sse_events(body: str) -> list[Any]:
    return [e[len("data: "):] if e[len("data: "):] == "[DONE]" else json.loads(e[len("data: "):])
            for e in body.split("\n\n") if e.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_stage_is_a_429_with_retry_after_not_a_500(stream: bool) -> None:
    status, headers, body = _run(FakePrefill(BackPressureError(num_queued_requests=1, max_queued_requests=1)),
                                 FakeDecode([]), stream)
    assert status == 429
    assert headers["retry-after"] == "2"
    err = json.loads(body)["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_stage_is_a_json_500_without_internals(stream: bool) -> None:
    status, _, body = _run(FakePrefill(RuntimeError(INTERNALS)), FakeDecode([]), stream)
    assert status == 500
    err = json.loads(body)["error"]
    assert err["type"] == "server_error" and "retry" in err["message"]
    for leak in ("6f1e2d3c4b5a", "48213", "10.1.2.3", "/tmp/ray", "ActorDiedError"):
        assert leak not in body


def test_decode_dying_mid_stream_gives_one_in_band_error_then_done() -> None:
    frames = [pack_events([TokenEvent("chatcmpl-1", 8, "b")]), pack_events([TokenEvent("chatcmpl-1", 9, "c")])]
    decode, prefill = FakeDecode(frames, then=RuntimeError(INTERNALS)), FakePrefill()
    status, _, body = _run(prefill, decode, stream=True)
    assert status == 200  # headers went out with the first token
    assert decode.received == [prefill.handoff]  # the hand-off bytes went on to decode untouched
    events = _sse_events(body)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2] if "choices" in e)
    assert text == "abc"  # every token that was generated reached the client
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error"
    for leak in ("6f1e2d3c4b5a", "48213", "10.1.2.3", "/tmp/ray"):
        assert leak not in body


def test_a_decode_stream_that_ends_early_is_an_error_not_a_silent_truncation() -> None:
    frames = [pack_events([TokenEvent("chatcmpl-1", 8, "b")])]  # no finished event, then the stream ends
    status, _, body = _run(FakePrefill(), FakeDecode(frames), stream=True)
    events = _sse_events(body)
    assert status == 200 and events[-1] == "[DONE]" and "error" in events[-2]


def test_an_error_event_from_decode_reaches_a_whole_response_as_a_500() -> None:
    frames = [pack_events([TokenEvent.failure("chatcmpl-1", "the request's KV could not be restored")])]
    status, _, body = _run(FakePrefill(), FakeDecode(frames), stream=False)
    assert status == 500
    assert "KV could not be restored" in json.loads(body)["error"]["message"]


def test_a_finished_stream_is_complete_and_cancels_nothing() -> None:
    frames = [pack_events([TokenEvent("chatcmpl-1", 8, "b"), TokenEvent("chatcmpl-1", 9, "c", finish_reason="length")])]
    decode = FakeDecode(frames)
    status, _, body = _run(FakePrefill(), decode, stream=True)
    events = _sse_events(body)
    assert status == 200 and events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert not decode.stream.cancelled


def _body_request(*messages: dict[str, Any]):
    """A Starlette request whose body arrives as ``messages`` (ASGI receive events), then nothing."""
    from starlette.requests import Request as StarletteRequest

    queue = list(messages)

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)  # a stalled upload
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    return StarletteRequest(scope, receive)


@pytest.mark.parametrize("messages, status, code", [
    ([{"type": "http.request", "body": b'{"model": ', "more_body": True}], 408, "request_timeout"),
    ([{"type": "http.request", "body": b'{"model": ', "more_body": True}, {"type": "http.disconnect"}], 499,
     "client_closed_request"),
    ([{"type": "http.request", "body": b'{"model": "m"}', "more_body": False}], 200, None),
], ids=["stalled", "hung-up", "whole"])
def test_a_body_that_stalls_or_is_abandoned_is_a_clear_4xx(messages, status: int, code: str | None) -> None:
    from strata.deployments.openai.http_input import read_json

    async def go():
        try:
            return 200, await read_json(_body_request(*messages), 1 << 20, timeout_s=0.2)
        except APIError as exc:
            return exc.status, exc.code

    got_status, got = asyncio.run(go())
    assert got_status == status
    assert got == ({"model": "m"} if status == 200 else code)


class _Counts:
    """Stands in for ``metrics.requests()``: the (endpoint, status) of every count."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.seen.append((tags["endpoint"], tags["status"]))


@pytest.mark.parametrize("read_all", [False, True], ids=["left-after-one-chunk", "read-to-done"])
def test_a_streams_status_is_counted_once_when_its_request_ends(monkeypatch, read_all: bool) -> None:
    """A client that leaves mid-stream leaves the generator suspended; its 499 is counted as the request
    ends, not whenever the garbage collector closes the generator (a dashboard's window, or never)."""
    from strata.deployments.openai import request_metrics as metrics

    counts = _Counts()
    monkeypatch.setattr(metrics, "requests", lambda: counts)

    async def events() -> AsyncIterator[list[TokenEvent]]:
        for i in range(3):
            yield [TokenEvent("chatcmpl-1", 5 + i, "x", finish_reason="length" if i == 2 else None)]

    async def go() -> list[tuple[str, str]]:
        responder = Responder("m", lambda ids: "x" * len(ids), retry_after_s=2.0, deadline_s=30.0)
        req = parse_request(ChatCompletionRequest, {"model": "m", "stream": True,
                                                    "messages": [{"role": "user", "content": "hi"}]})
        prepared = Request("chatcmpl-1", [1, 2, 3], SamplingParams(max_tokens=3))
        async with request_scope():
            resp = await responder.stream(req, prepared, events(), True, time.perf_counter())
            chunks = resp.body_iterator
            if read_all:
                body = "".join([c async for c in chunks])
                assert body.endswith("data: [DONE]\n\n")
            else:
                await chunks.__anext__()  # the role chunk, then the client is gone: the generator stays suspended
        at_end = list(counts.seen)
        await chunks.aclose()  # what the garbage collector does, later: must not count again
        assert counts.seen == at_end
        return at_end

    assert asyncio.run(go()) == [("chat", "200" if read_all else "499")]

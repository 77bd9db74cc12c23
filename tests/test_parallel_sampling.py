"""OpenAI's n in the ingress (``deployments.openai.parallel_sampling``), its failure paths in-process: a child that
fails ends the whole request (a JSON 500 before any byte, an in-band error then [DONE] once streaming), a
child that stops answering meets the request's deadline instead of waiting forever, and the others are
cancelled (their streams closed, which aborts them in the engine). Seeds: child i gets seed + i."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

from strata.deployments.openai.parallel_sampling import ManyChoices, children
from strata.deployments.openai.responder import Responder
from strata.pipeline.contract.request import Request, TokenEvent
from strata.pipeline.contract.sampling_params import SEED_MAX, SEED_MIN, SamplingParams

REQ = SimpleNamespace(requested_logprobs=lambda: None, include_usage=True)


def _kids(n: int, seed: int | None = 7) -> list[Request]:
    return children(Request("cmpl-1", [5, 6, 7], SamplingParams(max_tokens=4, seed=seed)), n)


def _start(behaviour: dict[str, str], closed: list[str]):
    """Each child's token stream: "ok" (two tokens, then stop), "error" (an error event), "hang" (silence)."""
    def start(req: Request):
        async def events():
            try:
                kind = behaviour[req.request_id]
                if kind == "hang":
                    await asyncio.sleep(3600)
                if kind == "error":
                    yield [TokenEvent.failure(req.request_id, "the stage failed")]
                    return
                yield [TokenEvent(req.request_id, 1, "a")]
                yield [TokenEvent(req.request_id, 2, "b", "stop")]
            finally:
                closed.append(req.request_id)
        return events()
    return start


def _body(response) -> dict:
    return json.loads(response.body)


async def _stream_text(response) -> str:
    return "".join([chunk async for chunk in response.body_iterator])


def test_children_get_their_own_ids_and_consecutive_seeds_wrapping_at_the_end() -> None:
    kids = _kids(3)
    assert [k.request_id for k in kids] == ["cmpl-1", "cmpl-1-1", "cmpl-1-2"]
    assert [k.params.seed for k in kids] == [7, 8, 9] and kids[1].prompt_token_ids == [5, 6, 7]
    assert [k.params.seed for k in _kids(2, SEED_MAX)] == [SEED_MAX, SEED_MIN]
    assert [k.params.seed for k in _kids(2, None)] == [None, None]


def test_every_choice_is_answered_and_usage_counts_the_prompt_once() -> None:
    many = ManyChoices(Responder("m", lambda ids: "", 1.0, 30.0))
    closed: list[str] = []
    start = _start({"cmpl-1": "ok", "cmpl-1-1": "ok", "cmpl-1-2": "ok"}, closed)
    body = _body(asyncio.run(many.whole(REQ, _kids(3), start, True, time.perf_counter())))
    assert [c["message"]["content"] for c in body["choices"]] == ["ab"] * 3
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 6


def test_a_failing_child_fails_the_request_and_the_others_are_closed() -> None:
    many = ManyChoices(Responder("m", lambda ids: "", 1.0, 30.0))
    closed: list[str] = []
    behaviour = {"cmpl-1": "ok", "cmpl-1-1": "error", "cmpl-1-2": "hang"}
    response = asyncio.run(many.whole(REQ, _kids(3), _start(behaviour, closed), True, time.perf_counter()))
    assert response.status_code == 500 and "the stage failed" in _body(response)["error"]["message"]
    assert set(closed) == {"cmpl-1", "cmpl-1-1", "cmpl-1-2"}  # the hanging one too: cancelled, never left waiting

    async def streamed() -> str:
        response = await many.stream(REQ, _kids(3), _start(behaviour, closed), True, time.perf_counter())
        return await _stream_text(response)

    text = asyncio.run(streamed())
    assert "the stage failed" in text and text.endswith("data: [DONE]\n\n")  # in-band, then the end


def test_a_child_that_stops_answering_meets_the_deadline() -> None:
    many = ManyChoices(Responder("m", lambda ids: "", 1.0, 0.5))  # 0.5 s per request
    closed: list[str] = []
    behaviour = {"cmpl-1": "ok", "cmpl-1-1": "hang"}
    response = asyncio.run(asyncio.wait_for(many.whole(REQ, _kids(2), _start(behaviour, closed), True,
                                                       time.perf_counter()), 10))
    assert response.status_code == 500 and "did not finish within" in _body(response)["error"]["message"]

"""No finish reason outside OpenAI's set reaches a client, for every reason the engine can produce.

The engine's reasons are not listed by hand: each one is produced by the engine core's own code
(eos, stop token, stop string, max_tokens, a failed sequence, an aborted one) on stand-in
schedulers, then sent through the real Responder, whole and streamed.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest

from strata.deployments.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from strata.deployments.openai.responses import (
    COMPLETED_FINISH_REASONS,
    OPENAI_FINISH_REASONS,
    IncompleteFinish,
    openai_finish_reason,
)
from strata.deployments.openai.admission import Admission
from strata.deployments.openai.request_end import request_scope
from strata.deployments.openai.responder import Responder
from strata.pipeline.core import sampler
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.request import Request, TokenEvent
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.engine_core import EngineCore
from strata.pipeline.core.sequence import Sequence

pytestmark = pytest.mark.unit

EOS, STOP_TOKEN = 2, 5


def _core() -> EngineCore:
    """An engine core whose scheduler holds every sequence (remove() succeeds) and whose tokenizer
    spells token t as one letter: enough for ``_append``, ``fail`` and ``abort`` to run for real."""
    scheduler = SimpleNamespace(remove=lambda seq, free_blocks: True, config=EngineConfig())
    def letters(ids: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in ids)

    return EngineCore(scheduler, runner=None, detokenize=letters, eos_token_ids=(EOS,))  # type: ignore[arg-type]


def _seq(**params: Any) -> Sequence:
    return Sequence("r", [1, 1, 1], SamplingParams(**{"max_tokens": 8, **params}), block_size=16)


def engine_reasons() -> dict[str, str]:
    """How a request ends -> the finish reason the engine core gives it."""
    core = _core()
    out: dict[str, str] = {}
    out["eos"] = core._append(_seq(), EOS)[1].finish_reason  # type: ignore[assignment]
    seq = _seq(stop_token_ids=[STOP_TOKEN])
    out["stop token"] = core._append(seq, STOP_TOKEN)[1].finish_reason  # type: ignore[assignment]
    seq = _seq(stop=["hh"])
    core._append(seq, 7)
    out["stop string"] = core._append(seq, 7)[1].finish_reason  # type: ignore[assignment]
    out["max_tokens"] = core._append(_seq(max_tokens=1), 7)[1].finish_reason  # type: ignore[assignment]
    core.fail(_seq(), "the model produced invalid values")
    out["failed"] = core._take_failed()[0][1].finish_reason  # type: ignore[assignment]
    seq = _seq()
    assert core.abort(seq)
    out["aborted (client gone, stage failed)"] = seq.finish_reason  # type: ignore[assignment]
    assert all(isinstance(r, str) for r in out.values()), out
    return out


ENGINE_REASONS = engine_reasons()
# every reason any version may put on an event: the engine's, the sampler's constants, and the
# legacy "eos" (events may cross versions during a rolling update)
ALL_REASONS = sorted({*ENGINE_REASONS.values(), *(v for k, v in vars(sampler).items() if k.startswith("FINISH_")),
                      *COMPLETED_FINISH_REASONS, "eos"})
INCOMPLETE = [r for r in ALL_REASONS if r not in COMPLETED_FINISH_REASONS]


def test_the_engine_produces_the_reasons_this_file_expects() -> None:
    """If the engine gains a reason, this shows it; the tests below then cover it automatically."""
    assert set(ENGINE_REASONS.values()) == {"stop", "length", "error", "abort"}
    assert {"abort", "error"} <= set(INCOMPLETE)


@pytest.mark.parametrize("reason", ALL_REASONS)
def test_the_mapping_gives_an_openai_value_or_refuses(reason: str) -> None:
    if reason in COMPLETED_FINISH_REASONS:
        assert openai_finish_reason(reason) in OPENAI_FINISH_REASONS
    else:
        with pytest.raises(IncompleteFinish):
            openai_finish_reason(reason)
    assert openai_finish_reason(None) is None
    with pytest.raises(IncompleteFinish):
        openai_finish_reason("something-new")  # an unknown reason is refused, never passed through


def test_what_each_way_of_ending_maps_to() -> None:
    mapped = {how: openai_finish_reason(r) if r in COMPLETED_FINISH_REASONS else None
              for how, r in ENGINE_REASONS.items()}
    assert mapped == {"eos": "stop", "stop token": "stop", "stop string": "stop", "max_tokens": "length",
                      "failed": None, "aborted (client gone, stage failed)": None}


async def _events(batches: list[list[TokenEvent]]) -> AsyncIterator[list[TokenEvent]]:
    for batch in batches:
        yield batch


def _respond(last: TokenEvent, stream: bool, chat: bool) -> tuple[int, str]:
    """One request whose tokens end with ``last``, through the real Responder: (status, body)."""
    async def go() -> tuple[int, str]:
        responder = Responder("m", lambda ids: "x" * len(ids), retry_after_s=1.0, deadline_s=30.0)
        body: dict[str, Any] = {"model": "m", "stream": stream,
                                "stream_options": {"include_usage": True} if stream else None}
        if chat:
            req = parse_request(ChatCompletionRequest, {**body, "messages": [{"role": "user", "content": "hi"}]})
        else:
            req = parse_request(CompletionRequest, {**body, "prompt": "hi"})
        prepared = Request("r", [1, 2, 3], SamplingParams(max_tokens=4))
        events = _events([[TokenEvent("r", 8, "a")], [TokenEvent("r", 9, "b"), last]])
        method = responder.stream if stream else responder.whole
        admission = Admission(4)
        async with request_scope():  # what RequestEndMiddleware gives every HTTP request
            assert admission.admit()
            resp = await method(req, prepared, events, chat, time.perf_counter())
            if hasattr(resp, "body_iterator"):
                text = "".join([c if isinstance(c, str) else c.decode() async for c in resp.body_iterator])
            else:
                text = resp.body.decode()
        assert admission.held == 0  # the request's slot came back as it ended
        return resp.status_code, text

    return asyncio.run(go())


def _finish_reasons(status: int, body: str, stream: bool) -> tuple[list[Any], list[dict]]:
    """Every finish_reason in the body, and the error objects in it."""
    objs = [json.loads(e[len("data: "):]) for e in body.split("\n\n")
            if e.startswith("data: ") and e != "data: [DONE]"] if stream else [json.loads(body)]
    reasons = [c["finish_reason"] for o in objs for c in o.get("choices", [])]
    return reasons, [o["error"] for o in objs if "error" in o]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("reason", ALL_REASONS)
def test_a_client_only_ever_sees_openai_finish_reasons(reason: str, stream: bool, chat: bool) -> None:
    last = TokenEvent.failure("r", "boom") if reason == "error" else TokenEvent("r", 10, "c", finish_reason=reason)
    status, body = _respond(last, stream, chat)
    reasons, errors = _finish_reasons(status, body, stream)
    assert set(reasons) - {None} <= OPENAI_FINISH_REASONS, body
    if reason in COMPLETED_FINISH_REASONS:  # a complete answer, with its reason
        assert status == 200 and not errors
        assert reasons[-1] == openai_finish_reason(reason)
    else:  # not complete: the error path, never a finish reason that would pass it off as complete
        assert errors and errors[-1]["type"] == "server_error", body
        assert set(reasons) == {None} or not reasons
        assert status == (200 if stream else 500)  # streamed: headers were out with the first token
        if stream:
            assert body.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_token_stream_that_ends_without_a_reason_is_an_error_whole_or_streamed(stream: bool) -> None:
    status, body = _respond(TokenEvent("r", 10, "c"), stream, chat=True)
    reasons, errors = _finish_reasons(status, body, stream)
    assert errors and set(reasons) <= {None}
    assert status == (200 if stream else 500)

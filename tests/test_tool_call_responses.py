"""Tool calls in the ingress's responses, in-process (``Responder`` and ``ManyChoices`` over scripted token
events): a whole answer's ``tool_calls`` with ``finish_reason: tool_calls`` and no content; a stream's
tool-call deltas (id and name once, argument fragments after) that add up to the whole answer, each chunk
valid against OpenAI's published stream schema; the same per choice with n = 2; a call cut by max_tokens
keeps ``length``; text without calls stays content."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from strata.deployments.openai.parallel_sampling import ManyChoices, children
from strata.deployments.openai.responder import Responder
from strata.pipeline.contract.request import Request, TokenEvent
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.frontend.answer import AnswerFormat
from strata.pipeline.frontend.tools.formats import Hermes

REQ = SimpleNamespace(requested_logprobs=lambda: None, include_usage=False)
HERMES = AnswerFormat(tools=Hermes(SimpleNamespace(added_tokens_decoder={})))  # markers as text
CALL = ['Sure.\n<tool_call>\n{"name": "add", ', '"arguments": {"a": 1', ', "b": 2}}\n</tool_call>']
SCHEMAS = json.loads((Path(__file__).parent / "data" / "openai_response_schemas.json").read_text())


def _validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**SCHEMAS[name], "$defs": SCHEMAS["$defs"]})


def _start(pieces: list[str], last_reason: str = "stop"):
    def start(req: Request):
        async def events():
            for i, text in enumerate(pieces):
                yield [TokenEvent(req.request_id, i + 1, text, last_reason if i == len(pieces) - 1 else None)]
        return events()
    return start


def _kids(n: int) -> list[Request]:
    return children(Request("chatcmpl-1", [5, 6, 7], SamplingParams(max_tokens=40)), n)


def _responder() -> Responder:
    return Responder("m", lambda ids: "", 1.0, 30.0)


def _chunks(respond) -> list[dict]:
    """The SSE events of the response ``respond()`` makes, read in the event loop that made it."""
    async def read() -> str:
        response = await respond()
        return "".join([chunk async for chunk in response.body_iterator])
    lines = [line.removeprefix("data: ") for line in asyncio.run(read()).splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _assembled(chunks: list[dict], index: int = 0) -> tuple[str, list[dict], str | None]:
    content, calls, reason = "", [], None
    for chunk in chunks:
        _validator("CreateChatCompletionStreamResponse").validate(chunk)
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            content += delta.get("content") or ""
            for part in delta.get("tool_calls", []):
                if "id" in part:
                    calls.append({"id": part["id"], "name": part["function"]["name"], "arguments": ""})
                calls[part["index"]]["arguments"] += part["function"]["arguments"]
            reason = choice["finish_reason"] or reason
    return content, calls, reason


def test_a_whole_answer_and_its_stream_carry_the_same_call() -> None:
    responder = _responder()
    prepared = _kids(1)[0]
    whole = asyncio.run(responder.whole(REQ, prepared, _start(CALL)(prepared), True, time.perf_counter(), HERMES))
    body = json.loads(whole.body)
    _validator("CreateChatCompletionResponse").validate(body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'} and call["id"].startswith("call_")

    content, calls, reason = _assembled(_chunks(lambda: responder.stream(
        REQ, prepared, _start(CALL)(prepared), True, time.perf_counter(), HERMES)))
    assert content == "Sure." and reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("add", '{"a": 1, "b": 2}')]


def test_a_call_cut_short_keeps_length_and_text_stays_content() -> None:
    responder = _responder()
    prepared = _kids(1)[0]
    cut = json.loads(asyncio.run(responder.whole(REQ, prepared, _start(CALL[:2], "length")(prepared), True,
                                                 time.perf_counter(), HERMES)).body)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": 1'
    plain = json.loads(asyncio.run(responder.whole(REQ, prepared, _start(["No call ", "needed."])(prepared), True,
                                                   time.perf_counter(), HERMES)).body)["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"]["content"] == "No call needed."
    assert "tool_calls" not in plain["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_choice_of_n_carries_its_calls(stream: bool) -> None:
    many = ManyChoices(_responder())
    if not stream:
        body = json.loads(asyncio.run(many.whole(REQ, _kids(2), _start(CALL), True, time.perf_counter(), HERMES)).body)
        _validator("CreateChatCompletionResponse").validate(body)
        for choice in body["choices"]:
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'
        return

    chunks = _chunks(lambda: many.stream(REQ, _kids(2), _start(CALL), True, time.perf_counter(), HERMES))
    for index in (0, 1):
        content, calls, reason = _assembled(chunks, index)
        assert content == "Sure." and reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == [("add", '{"a": 1, "b": 2}')]

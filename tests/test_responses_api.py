"""``POST /v1/responses`` through the real ingress route, in-process (the ingress of
``test_output_limit_params``: the real class, its flow a stand-in that records each prepared request and
answers one token): the request becomes the chat request it asks for, the answer is a ``response`` object
or its event stream valid against the openai SDK's own schema, and what it cannot do is a 400 naming it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from starlette.requests import Request as HTTPRequest
from test_output_limit_params import MODEL, FakeFlow, _ingress

from strata.deployments.openai.request_end import request_scope
from strata.deployments.openai.responses_request import ResponsesRequest
from strata.pipeline.contract.request import TokenEvent

pytestmark = pytest.mark.unit
RESPONSE_SCHEMA = Response.model_json_schema()
EVENT_SCHEMA = TypeAdapter(ResponseStreamEvent).json_schema()


def _post(body: dict[str, Any], flow_type: type = FakeFlow) -> tuple[int, Any, FakeFlow]:
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/responses",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def go() -> tuple[int, Any, FakeFlow]:
        flow = flow_type()
        ingress = _ingress(flow)
        async with request_scope():
            resp = await ingress.responses(HTTPRequest(scope, receive))
            if body.get("stream") and resp.status_code == 200:
                text = "".join([c if isinstance(c, str) else c.decode() async for c in resp.body_iterator])
                return resp.status_code, text, flow
        return resp.status_code, json.loads(resp.body), flow

    return asyncio.run(go())


def test_a_whole_response_is_valid_and_carries_the_answer() -> None:
    status, body, flow = _post({"model": MODEL, "input": "hi", "instructions": "Be brief.", "max_output_tokens": 5,
                                "temperature": 0.5})
    assert status == 200, body
    jsonschema.validate(body, RESPONSE_SCHEMA)
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["model"] == MODEL
    (item,) = body["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "ok"
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["input_tokens"] == 3 and body["usage"]["output_tokens"] == 1
    (params,) = flow.prepared
    assert params.max_tokens == 5 and params.temperature == 0.5
    assert flow.prompts[0]["messages"][0] == {"role": "system", "content": "Be brief."}


def test_a_stream_is_numbered_events_each_valid_ending_in_the_whole_response() -> None:
    status, text, _ = _post({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                      "text": "hi"}]}],
                             "stream": True})
    assert status == 200, text
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        jsonschema.validate(event, EVENT_SCHEMA)
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "ok" and final["usage"]["output_tokens"] == 1


def test_earlier_calls_and_their_outputs_become_the_chat_history() -> None:
    req = ResponsesRequest(model=MODEL, tools=[{"type": "function", "name": "get", "parameters": {"type": "object"}}],
                           input=[{"role": "developer", "content": "Use tools."},
                                  {"role": "user", "content": "weather?"},
                                  {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
                                  {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{}"},
                                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                                  {"type": "reasoning", "id": "rs_1", "summary": []}],
                           text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
                           tool_choice={"type": "function", "name": "get"})
    chat = req.chat_body()
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["c1", "c2"]  # one turn, one message
    assert chat["tools"] == [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}


@pytest.mark.parametrize("body, param, words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "does not keep"),
    ({"background": True}, "background", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools", "function tools only"),
    ({"input": [{"type": "input_file", "file_id": "f"}]}, "input", "does not take"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input", "input_text and input_image"),
    ({"text": {"format": {"type": "xml"}}}, "text", "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": 7}, "input", "input"),
])
def test_what_it_cannot_do_is_a_400_naming_the_parameter(body: dict[str, Any], param: str, words: str) -> None:
    status, err, flow = _post({"model": MODEL, "input": "hi", **body})
    assert status == 400 and err["error"]["param"].startswith(param) and words in err["error"]["message"], err
    assert not flow.prepared


def test_a_chat_error_names_the_responses_parameter() -> None:
    status, err, _ = _post({"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f"}],
                            "tool_choice": "sometimes"})
    assert status == 400 and err["error"]["param"] == "tool_choice", err
    status, err, _ = _post({"model": "other", "input": "hi"})
    assert status == 404 and err["error"]["code"] == "model_not_found"


class FailingFlow(FakeFlow):
    """A stream that fails after its first token (a stage that stopped, say)."""

    async def events(self, request):  # type: ignore[override]
        yield [TokenEvent(request.request_id, 7, "ok")]
        yield [TokenEvent(request.request_id, -1, "", finish_reason="error", error="the engine stopped")]


def test_a_stream_that_fails_midway_ends_in_an_error_event() -> None:
    """No client waits for a completion that will not come: the chat stream's in-band error becomes the
    Responses ``error`` event, valid against the SDK's schema, and the stream ends there."""
    status, text, _ = _post({"model": MODEL, "input": "hi", "stream": True}, FailingFlow)
    assert status == 200
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and "the engine stopped" in events[-1]["message"]
    assert "response.output_text.delta" in [e["type"] for e in events]
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in events)
    jsonschema.validate(events[-1], EVENT_SCHEMA)

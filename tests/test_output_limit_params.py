"""``max_tokens`` and ``max_completion_tokens`` through the real ingress route, in-process (no Ray
cluster): both are checked (strict integers, in range) whichever is given, a bad one is a 400
naming it, and when both are given ``max_completion_tokens`` is the limit (as in vLLM).

The ingress is the real class without its constructor (no model is loaded); its request flow is a
stand-in that records what reaches it and answers with one finished token.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, AsyncIterator

import pytest
from starlette.requests import Request as HTTPRequest

from strata.deployments.openai.admission import Admission
from strata.deployments.ray_serve.config import ServeConfig
from strata.deployments.ray_serve.ingress import Ingress
from strata.deployments.openai.request_end import request_scope
from strata.deployments.openai.responder import Responder
from strata.pipeline.contract.request import Request, TokenEvent
from strata.pipeline.contract.sampling_params import MAX_TOKENS, SamplingParams
from strata.pipeline.frontend.generation_defaults import GenerationDefaults

pytestmark = pytest.mark.unit

MODEL = "m"


class FakeFlow:
    """Records the params of each prepared request."""

    def __init__(self) -> None:
        self.prepared: list[SamplingParams] = []
        self.prompts: list[dict[str, Any]] = []

    async def prepare(self, request_id: str, params: SamplingParams, images: list[bytes], **prompt: Any) -> Request:
        self.prepared.append(params)
        self.prompts.append(prompt)
        return Request(request_id, [1, 2, 3], params)

    async def events(self, request: Request) -> AsyncIterator[list[TokenEvent]]:
        yield [TokenEvent(request.request_id, 7, "ok", finish_reason="length")]


class _Ingress(Ingress.func_or_class):  # type: ignore[misc,name-defined]
    def __del__(self) -> None:
        """Serve's ASGI wrapper shuts an app down here (a coroutine); this one never started one."""


def _ingress(flow: FakeFlow, reasoning: Any = None, generation: GenerationDefaults = GenerationDefaults()) -> Any:
    ingress = object.__new__(_Ingress)
    config = ServeConfig()
    ingress.config, ingress.model_name, ingress.flow, ingress.service = config, MODEL, flow, None
    ingress.retry_after_s, ingress.admission, ingress.reasoning_format = 1.0, Admission(16), reasoning
    ingress.generation = generation
    ingress.responder = Responder(MODEL, lambda ids: "x" * len(ids), 1.0, 30.0)
    ingress._loaded, ingress._load_error = threading.Event(), None
    ingress._loaded.set()
    return ingress


def _post(body: dict[str, Any], chat: bool = True, reasoning: Any = None,
          generation: GenerationDefaults = GenerationDefaults()) -> tuple[int, dict[str, Any], FakeFlow]:
    """POST ``body`` to the chat (or completions) route: (status, JSON body, the flow)."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions" if chat else "/v1/completions",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def go() -> tuple[int, dict[str, Any], FakeFlow]:
        flow = FakeFlow()
        ingress = _ingress(flow, reasoning, generation)
        async with request_scope():  # what RequestEndMiddleware gives every HTTP request
            resp = await ingress._complete(HTTPRequest(scope, receive), chat=chat)
        assert ingress.admission.held == 0
        return resp.status_code, json.loads(resp.body), flow

    return asyncio.run(go())


def _chat(**limits: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **limits}


BAD = [0, -1, MAX_TOKENS + 1, 2**70, True, False, 4.0, "4", [4], {"n": 4}]


@pytest.mark.parametrize("bad", BAD, ids=repr)
@pytest.mark.parametrize("field,other", [("max_tokens", None), ("max_completion_tokens", None),
                                         ("max_tokens", "max_completion_tokens"),
                                         ("max_completion_tokens", "max_tokens")])
def test_a_bad_limit_is_a_400_naming_it_whichever_is_given(field: str, other: str | None, bad: Any) -> None:
    limits = {field: bad} if other is None else {field: bad, other: 8}
    status, body, flow = _post(_chat(**limits))
    assert status == 400, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field and field in err["message"]
    assert not flow.prepared  # refused before anything was tokenized


@pytest.mark.parametrize("bad", [0, MAX_TOKENS + 1, True, 4.0], ids=repr)
def test_completions_check_max_tokens_the_same_way(bad: Any) -> None:
    status, body, _ = _post({"model": MODEL, "prompt": "hi", "max_tokens": bad}, chat=False)
    assert status == 400 and body["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("limits,expected", [
    ({"max_tokens": 5}, 5),
    ({"max_completion_tokens": 6}, 6),
    ({"max_tokens": 5, "max_completion_tokens": 9}, 9),  # both: max_completion_tokens wins (vLLM)
    ({"max_tokens": 9, "max_completion_tokens": 5}, 5),
    ({"max_tokens": MAX_TOKENS, "max_completion_tokens": 1}, 1),  # the limits themselves are in range
    ({"max_tokens": 5, "max_completion_tokens": None}, 5),
], ids=repr)
def test_the_limit_in_force(limits: dict[str, Any], expected: int) -> None:
    status, body, flow = _post(_chat(**limits))
    assert status == 200, body
    (params,) = flow.prepared
    assert params.max_tokens == expected
    assert body["choices"][0]["finish_reason"] == "length"


def test_no_limit_leaves_the_rest_of_the_context() -> None:
    status, _, flow = _post(_chat())
    assert status == 200
    (params,) = flow.prepared
    assert params.max_tokens is None  # intake widens it to the room the prompt leaves


def test_harmony_answers_keep_their_special_tokens_for_the_reader() -> None:
    """gpt-oss's channels are special tokens: a chat request with the harmony reader detokenizes with them kept
    (else nothing could be read apart); a completion is the text as written, special tokens skipped as asked."""
    from strata.pipeline.frontend.reasoning import REASONING_FORMATS

    harmony = REASONING_FORMATS["openai_gptoss"]
    status, body, flow = _post(_chat(max_tokens=4), reasoning=harmony)
    assert status == 200 and flow.prepared[0].skip_special_tokens is False and body["choices"][0]["message"]["content"]
    status, _, flow = _post({"model": MODEL, "prompt": "hi", "max_tokens": 4}, chat=False, reasoning=harmony)
    assert status == 200 and flow.prepared[0].skip_special_tokens is True


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_a_400() -> None:
    status, _, flow = _post(_chat(max_tokens=4, chat_template_kwargs={"enable_thinking": False}))
    assert status == 200 and flow.prompts[0]["template_kwargs"] == {"enable_thinking": False}
    for bad in ({"tokenize": True}, {"not a name": 1}, [1]):
        status, body, flow = _post(_chat(max_tokens=4, chat_template_kwargs=bad))
        assert status == 400 and body["error"]["param"] == "chat_template_kwargs" and not flow.prepared


def test_the_checkpoints_generation_defaults_fill_only_what_a_request_leaves_out() -> None:
    """``--generation-config auto``: the route samples at generation_config.json's values unless the request
    names its own (``tests/test_generation_defaults.py`` reads the file)."""
    defaults = GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05)
    _, _, flow = _post(_chat(), generation=defaults)
    (params,) = flow.prepared
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.9, 20, 1.05)
    _, _, flow = _post(_chat(temperature=0, top_p=1.0, top_k=-1, repetition_penalty=1.0), generation=defaults)
    (params,) = flow.prepared
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.0, 1.0, 0, 1.0)
    _, _, flow = _post({"model": MODEL, "prompt": "hi"}, chat=False, generation=defaults)
    assert flow.prepared[0].temperature == 0.6

"""What vLLM users reach for on day one, against a real `strata serve` of real weights (SmolLM2-135M-
Instruct, see test_real_weights.py) started with ``--api-key``: transformers' answer through the openai
client, whole and streamed; responses that validate against OpenAI's published schemas (whole and
streamed, both endpoints: the openai client is lenient, a strict validator is not); 401 without the
right Bearer token on every route but /health; structured output (a JSON schema answered with valid JSON);
tool calls (the server runs a Hermes-style tools template, ``tests/data/smollm2_tools.jinja``, which renders
chats without tools exactly as the model's own);
``/tokenize`` and ``/detokenize`` on the model's own tokenizer; ``/ping``, ``/version`` and ``/metrics``
on the API port."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from helpers import MODEL_NAME, SMOLLM2_ALIAS, SMOLLM2_KEY

pytestmark = pytest.mark.serve  # the session's real SmolLM2 server, started with an API key

SCHEMAS = json.loads((Path(__file__).parent / "data" / "openai_response_schemas.json").read_text())
KEY = SMOLLM2_KEY  # the shared SmolLM2 server's (conftest's ``keyed_server``)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


def _validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**SCHEMAS[name], "$defs": SCHEMAS["$defs"]})


def _events(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def test_the_openai_client_gets_transformers_answer_from_real_weights(keyed_server) -> None:
    client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0)
    assert reply.choices[0].message.content == "The capital of France is Paris."  # transformers' greedy answer
    assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content


def test_responses_validate_against_openais_published_schemas(keyed_server) -> None:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 6, "temperature": 0}
    whole = _post(keyed_server, "/v1/chat/completions", chat)
    assert whole.status_code == 200
    _validator("CreateChatCompletionResponse").validate(whole.json())
    assert whole.json()["choices"][0]["message"]["refusal"] is None
    streamed = _post(keyed_server, "/v1/chat/completions", {**chat, "stream": True,
                                                             "stream_options": {"include_usage": True}})
    for event in _events(streamed):
        _validator("CreateChatCompletionStreamResponse").validate(event)
    completion = {"model": MODEL_NAME, "prompt": "The sea is", "max_tokens": 6, "temperature": 0}
    _validator("CreateCompletionResponse").validate(_post(keyed_server, "/v1/completions", completion).json())
    for event in _events(_post(keyed_server, "/v1/completions", {**completion, "stream": True})):
        _validator("CreateCompletionResponse (streamed)").validate(event)
    # and the validator is strict: today's message without refusal would fail it
    broken = whole.json()
    del broken["choices"][0]["message"]["refusal"]
    with pytest.raises(jsonschema.ValidationError, match="refusal"):
        _validator("CreateChatCompletionResponse").validate(broken)


def test_the_api_key_guards_every_route_but_the_probes(keyed_server) -> None:
    """/health, /ping, /version and /metrics stay open without a key (as in vLLM: probes and scrapers)."""
    base = keyed_server.base_url
    for path in ("/health", "/ping", "/version", "/metrics"):
        assert httpx.get(base + path, timeout=30).status_code == 200, path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/strata/stats"),
                             ("POST", "/tokenize"), ("GET", "/v1/models/" + MODEL_NAME), ("GET", "/tokenizer_info")):
            response = httpx.request(method, base + path, headers=headers, json={}, timeout=30)
            assert response.status_code == 401, (headers, path)
            assert response.json()["error"]["code"] == "invalid_api_key" and KEY not in response.text
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert client.models.list().data[0].id == MODEL_NAME
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="not-it", max_retries=0).models.list()


def test_the_raw_key_is_in_no_process_but_the_cli_it_was_handed_to(keyed_server) -> None:
    """Started with STRATA_API_KEY: no process of the server (raylet, GCS, every replica, their workers and
    children) holds the raw key in its environment or command line; the CLI, which was handed it, does."""
    import psutil

    holders = []
    for proc in psutil.process_iter():
        try:
            env, cmdline = proc.environ(), proc.cmdline()
        except psutil.Error:  # gone, or not ours to read
            continue
        if any(KEY in value for value in env.values()) or any(KEY in arg for arg in cmdline):
            holders.append(proc.pid)
    assert holders == [keyed_server.proc.pid]


def test_tokenize_and_detokenize_use_the_models_tokenizer(keyed_server, smollm2: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    got = _post(keyed_server, "/tokenize", {"model": MODEL_NAME, "prompt": "The sea is calm tonight."}).json()
    assert got["tokens"] == tok("The sea is calm tonight.")["input_ids"] and got["count"] == len(got["tokens"])
    assert got["max_model_len"] > 0
    chat = _post(keyed_server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok(rendered)["input_ids"]
    back = _post(keyed_server, "/detokenize", {"model": MODEL_NAME, "tokens": got["tokens"]}).json()
    assert back["prompt"] == tok.decode(got["tokens"])
    for path, body, status in (("/tokenize", {"prompt": "a", "messages": []}, 400), ("/detokenize", {"tokens": [10**9]}, 400),
                               ("/detokenize", {"tokens": "abc"}, 400), ("/tokenize", {"model": "other", "prompt": "a"}, 404)):
        response = _post(keyed_server, path, body)
        assert response.status_code == status and "error" in response.json(), (path, body)


def test_tokenizer_info_is_the_tokenizers_configuration_and_the_template_in_use(keyed_server, smollm2: Path) -> None:
    """vLLM's /tokenizer_info (on with --enable-tokenizer-info-endpoint): what lm-eval's remote tokenizer reads,
    the chat template this server renders with (its --chat-template), and no path of the server's."""
    info = httpx.get(keyed_server.base_url + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=30).json()
    template = (Path(__file__).parent / "data" / "smollm2_tools.jinja").read_text()
    assert info["tokenizer_class"].startswith(("GPT2Tokenizer", "TokenizersBackend", "PreTrainedTokenizer"))
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == template
    assert str(smollm2) not in json.dumps(info) and "name_or_path" not in info


def test_ping_version_and_metrics_on_the_api_port(keyed_server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    base = keyed_server.base_url
    assert httpx.get(base + "/ping", headers=headers, timeout=30).status_code == 200
    assert httpx.get(base + "/version", headers=headers, timeout=30).json()["version"]
    _post(keyed_server, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    text = httpx.get(base + "/metrics", headers=headers, timeout=30).text
    assert "strata_requests" in text and "# TYPE" in text  # the families the metrics port exports
    assert "strata_preemptions" in text  # exported at 0 before the first preemption: its panel is never empty


def test_prompt_lookup_speculation_is_served_exactly_and_counted(keyed_server, smollm2: Path) -> None:
    """This server decodes with ``--speculative-config`` (ngram; conftest): a chat that repeats given text
    streams the plain in-process engine's greedy answer, and ``/metrics`` counts the drafts it accepted."""
    from helpers import build, greedy, wait_until

    text = ("The lighthouse stood on the northern cape for two hundred years. Every night its keeper climbed "
            "the ninety steps and trimmed the wick.")
    messages = [{"role": "user", "content": f"Repeat this text word for word:\n\n{text}"}]
    client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=40, temperature=0,
                                            stream=True)
    served = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert served == build(smollm2).generate([{"messages": messages, "params": greedy(40)}])[0].text

    def counted(kind: str) -> float:
        lines = httpx.get(keyed_server.base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"},
                          timeout=30).text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines
                   if "strata_spec_decode_tokens" in line and f'kind="{kind}"' in line and not line.startswith("#"))

    wait_until(lambda: counted("accepted") > 0, 60, "accepted drafts in /metrics")
    assert counted("drafted") >= counted("accepted")


def test_structured_output_through_the_openai_client(keyed_server) -> None:
    """response_format json_schema, whole and streamed: the real model's answer parses, validates and says
    Paris; vLLM's guided_choice on completions; an invalid schema is a 400 naming the problem."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "country": {"type": "string", "maxLength": 40}},
              "required": ["city", "country"], "additionalProperties": False}
    client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=40, temperature=0,
                                           response_format=fmt)
    assert whole.choices[0].finish_reason == "stop"
    answer = json.loads(whole.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert "Paris" in answer["city"]
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=40, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content
    choice = client.completions.create(model=MODEL_NAME, prompt="Is Paris in France? Answer yes or no:", max_tokens=5,
                                       temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "intt"}}})


def test_tool_calls_through_the_openai_client(keyed_server) -> None:
    """tool_choice required: a get_weather call for Paris with finish_reason tool_calls, streamed as OpenAI's
    tool-call deltas that add up to it, both valid against OpenAI's schemas, its prompt counted by /tokenize
    with the same tools; auto with the tool's result
    sent back as a ``tool`` message: the model answers from it; bad tools are 400s naming them."""
    client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    ask = dict(model=MODEL_NAME, messages=messages, tools=[WEATHER_TOOL], max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    _validator("CreateChatCompletionResponse").validate(whole.model_dump(exclude_unset=True))
    counted = _post(keyed_server, "/tokenize", {"messages": messages, "tools": [WEATHER_TOOL]}).json()["count"]
    assert whole.usage.prompt_tokens == counted  # /tokenize renders the tools as the completion did

    streamed = _post(keyed_server, "/v1/chat/completions", {**ask, "tool_choice": "required",
                                                            "parallel_tool_calls": False, "stream": True})
    events = _events(streamed)
    for event in events:
        _validator("CreateChatCompletionStreamResponse").validate(event)
    parts = [tc for e in events for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert parts[0]["id"] and parts[0]["function"]["name"] == "get_weather" and {p["index"] for p in parts} == {0}
    assert "".join(p["function"]["arguments"] for p in parts) == call.function.arguments
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    answer = client.chat.completions.create(**{**ask, "messages": messages}).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls and "sunny" in answer.message.content

    for bad, param in (({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
                       ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                       ({"messages": [{"role": "tool", "content": "x"}]}, None)):
        response = _post(keyed_server, "/v1/chat/completions", {**ask, **bad})
        assert response.status_code == 400, bad
        assert param is None or response.json()["error"]["param"] == param


def test_the_openai_client_retrieves_the_model_and_a_404_for_another(keyed_server) -> None:
    """The served name and its alias (``model_aliases``: vLLM's further --served-model-name values) both
    answer; the card names the served name."""
    client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY)
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    assert client.models.retrieve(SMOLLM2_ALIAS).id == MODEL_NAME
    answer = client.completions.create(model=SMOLLM2_ALIAS, prompt="Hello", max_tokens=2, temperature=0)
    assert answer.model == MODEL_NAME and answer.choices[0].text
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("org/another-model")
    assert err.value.body["code"] == "model_not_found"


def test_several_prompts_in_one_completion_request(keyed_server) -> None:
    """vLLM's batch form: texts or token-id lists, n choices each, indexed prompt by prompt; each choice is
    that prompt's answer alone, and usage counts each prompt once. Past 16 choices is a 400."""
    client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY)
    prompts = ["The capital of France is", "One, two, three,"]
    alone = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    both = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    ids = httpx.post(keyed_server.base_url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                     json={"model": MODEL_NAME, "prompt": prompts[1]}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=[ids, ids], max_tokens=5, temperature=0)
    assert [c.text for c in by_ids.choices] == [alone[1].choices[0].text] * 2
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=["a"] * 9, max_tokens=2, n=2)


def test_the_responses_api_through_the_openai_client(keyed_server) -> None:
    """``client.responses.create``: the chat route's greedy answer as a response object, streamed as Responses
    events that add up to it, a required tool call as a function_call item, and its output sent back as a
    ``function_call_output`` item answered from (the chat test's tool flow, in the Responses API's shapes)."""
    client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    question = "What is the capital of France?"
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": question}],
                                          max_tokens=16, temperature=0)
    whole = client.responses.create(model=MODEL_NAME, input=question, max_output_tokens=16, temperature=0)
    assert whole.output_text == chat.choices[0].message.content and whole.usage.input_tokens == chat.usage.prompt_tokens
    deltas, final = [], None
    for event in client.responses.create(model=MODEL_NAME, input=question, max_output_tokens=16, temperature=0,
                                         stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert "".join(deltas) == whole.output_text == final.output_text

    tool = {"type": "function", **WEATHER_TOOL["function"]}
    ask = dict(model=MODEL_NAME, tools=[tool], max_output_tokens=40, temperature=0)
    called = client.responses.create(**ask, input="What is the weather like in Paris today?", tool_choice="required",
                                     parallel_tool_calls=False)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    answer = client.responses.create(**ask, input=[
        {"role": "user", "content": "What is the weather like in Paris today?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21, "sky": "sunny"}'}])
    assert "sunny" in answer.output_text and not [i for i in answer.output if i.type == "function_call"]

"""Text-only LLMs through the real `strata serve`: a DeepSeek-V3 as it is released (MLA, grouped MoE, FP8
weights with block scales, written by compressed-tensors) served disaggregated, its decode a
tensor-parallel group of two reading its slices of the FP8 codes and scales; the official openai client
gets the in-process engine's answers, streamed or not, and an image is a 400 that says the model takes
none. No Preprocess or Encode deployment is started for it. Then a MiniMax-M2 with its own tool syntax and a
template that opens the thinking: calls read by the declared parameter types, reasoning apart from content. And
the 2026 attentions, each served in one stage: Qwen3-Next and Kimi-Linear (linear-attention hybrids) and
DeepSeek-V3.2 (DSA sparse attention)."""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers import MODEL_NAME, build, greedy

pytestmark = pytest.mark.slow  # a server of its own

PROMPTS = ["What is the capital of France?", "Tell me about the tides and the moon. " * 4]
PNG_1PX = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGA"
           "hKmMIQAAAABJRU5ErkJggg==")


@pytest.fixture(scope="module")
def deepseek_dir(quantized_models):
    return quantized_models["deepseek_v3-fp8"][0]


@pytest.fixture(scope="module")
def deepseek_server(deepseek_dir, tmp_path_factory: pytest.TempPathFactory):
    from serve_process import ServeProcess, stop_later

    workdir = tmp_path_factory.mktemp("serve-deepseek")
    config = {"mode": "disaggregated", "engine": {"max_model_len": 1024, "host_kv_blocks": 1024,
                                                  "host_kv_dir": str(workdir / "host")},
              "stages": {"decode": {"tp": 2}}}
    server = ServeProcess(deepseek_dir, workdir, config)
    try:
        server.wait_ready()
        yield server
    finally:
        stop_later(server)


@pytest.fixture(scope="module")
def client(deepseek_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=deepseek_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_and_stream_equal_the_in_process_engine(client: openai.OpenAI, deepseek_dir) -> None:
    engine = build(deepseek_dir)
    expected = engine.generate([{"prompt": p, "params": greedy(12, ignore_eos=True)} for p in PROMPTS])
    for prompt, exp in zip(PROMPTS, expected):
        messages = [{"role": "user", "content": prompt}]
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == exp.text
        assert reply.usage.prompt_tokens == exp.num_prompt_tokens and reply.usage.completion_tokens == 12
        stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True}, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == exp.text


def test_text_parts_are_joined_for_a_text_template(client: openai.OpenAI, deepseek_dir) -> None:
    engine = build(deepseek_dir)
    expected = engine.generate([{"prompt": "first line\nsecond line", "params": greedy(8)}])[0]
    parts = [{"type": "text", "text": "first line"}, {"type": "text", "text": "second line"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": parts}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == expected.text


def test_an_image_is_a_400_that_says_the_model_takes_none(client: openai.OpenAI) -> None:
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": PNG_1PX}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": content}], max_tokens=4)
    assert "takes no images" in info.value.body["message"]


def test_no_image_stages_are_deployed(deepseek_server) -> None:
    apps = httpx.get(deepseek_server.dashboard_url + "/api/serve/applications/", timeout=30).json()["applications"]
    deployments = apps["strata"]["deployments"]
    assert set(deployments) == {"Ingress", "Prefill", "Decode"}
    assert all(d["status"] in ("HEALTHY", "UPSCALING", "DOWNSCALING") for d in deployments.values()), deployments


# ---------------------------------------------------------------- MiniMax-M2 and its tool syntax

LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"code": {"enum": ["123", "456"]}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
    "required": ["code", "n"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def minimax_server(tmp_path_factory: pytest.TempPathFactory):
    from serve_process import ServeProcess, stop_later

    from strata.checkpoints.tiny_text_models import build_tiny_text_model

    workdir = tmp_path_factory.mktemp("serve-minimax")
    from strata.checkpoints.tiny_tool_templates import TOOL_TEMPLATES

    model = build_tiny_text_model("minimax_m2", workdir / "model", tool_format="minimax_m2")
    # its tools template, with a generation prompt that opens the thinking (as DeepSeek-R1's does)
    thinking = TOOL_TEMPLATES["minimax_m2"].replace("'assistant:'", "'assistant:<think>\\n'")
    assert thinking != TOOL_TEMPLATES["minimax_m2"]
    server = ServeProcess(model, workdir, {"engine": {"max_model_len": 1024}, "chat_template": thinking})
    server.model_dir = model
    try:
        server.wait_ready()
        yield server
    finally:
        stop_later(server)


def test_minimax_m2_tool_calls_are_read_by_the_declared_types(minimax_server) -> None:
    """MiniMax-M2 served with its own call syntax (found in its chat template): a required call's string
    parameter stays a string though it reads as a number ("123"), the integer one is an integer, the
    streamed deltas add up to the whole call, and both satisfy the schema."""
    import json

    import jsonschema

    client = openai.OpenAI(base_url=minimax_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Look up code 123."}], tools=[LOOKUP],
               tool_choice="required", parallel_tool_calls=False, max_tokens=128, temperature=0)
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, LOOKUP["function"]["parameters"])
    assert isinstance(arguments["code"], str) and isinstance(arguments["n"], int)
    parts = [tc for chunk in client.chat.completions.create(**ask, stream=True) if chunk.choices
             for tc in chunk.choices[0].delta.tool_calls or []]
    assert parts[0].function.name == "lookup"
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments


def test_a_response_format_constrains_the_answer_after_the_thinking(minimax_server) -> None:
    """The prompt opened the thinking, so a guided_choice applies from ``</think>`` on (vLLM's structured output
    with a reasoning parser): the thinking is free and the answer one of the choices. A bias on the end tag
    closes the thinking at once; without it the random model never closes it, and nothing is constrained."""
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(minimax_server.model_dir).convert_tokens_to_ids("</think>")
    client = openai.OpenAI(base_url=minimax_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=16,
               temperature=0)
    closed = client.chat.completions.create(**ask, logit_bias={str(end): 100},
                                            extra_body={"guided_choice": ["yes", "no"]}).choices[0]
    assert closed.message.content in ("yes", "no") and closed.finish_reason == "stop", closed
    assert closed.message.model_extra["reasoning_content"] == ""
    open_ = client.chat.completions.create(**ask, extra_body={"guided_choice": ["yes", "no"]}).choices[0]
    assert open_.message.content is None and open_.finish_reason == "length"
    assert open_.message.model_extra["reasoning_content"] not in ("", "yes", "no")  # free text, as thinking is


def test_minimax_m2_thinking_comes_back_apart_from_the_answer(minimax_server) -> None:
    """The chat template opens the thinking, so the parser (auto) reads everything up to ``</think>`` as
    reasoning: a random model that never closes it answers with reasoning only, under both names, and the
    streamed reasoning deltas add up to the whole; a completion is the text as written."""
    client = openai.OpenAI(base_url=minimax_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Why is the sky blue?"}], max_tokens=12,
               temperature=0, extra_body={"ignore_eos": True})
    message = client.chat.completions.create(**ask).choices[0].message
    thinking = message.model_extra["reasoning_content"]
    assert thinking and message.model_extra["reasoning"] == thinking and message.content is None
    streamed = [c.choices[0].delta for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in streamed) == thinking
    assert not "".join(d.content or "" for d in streamed)


@pytest.fixture(scope="module", params=["qwen3_next", "kimi_linear", "deepseek_v32", "deepseek_v4"])
def frontier_server(request, text_models, tmp_path_factory: pytest.TempPathFactory):
    """Each 2026 attention served in turn: Qwen3-Next (Gated DeltaNet + gated GQA), Kimi-Linear (KDA + NoPE
    MLA; served disaggregated, decoded by a tp=2 group of Ray actors: a tp=1 prefill's state is split over two
    ranks), DeepSeek-V3.2 (DSA sparse MLA), DeepSeek-V4 (compressed attention and mHC; served disaggregated, decoded
    at tp=2: its windows, projections and entries cross in the hand-off to a group that replicates them);
    ``server.model`` is its checkpoint."""
    from serve_process import ServeProcess, stop_later

    config = {"engine": {"max_model_len": 1024}}
    if request.param in ("kimi_linear", "deepseek_v4"):
        config.update(mode="disaggregated", stages={"decode": {"tp": 2}})
    server = ServeProcess(text_models[request.param], tmp_path_factory.mktemp(f"serve-{request.param}"), config)
    server.model, server.decode_tp = text_models[request.param], config.get("stages", {}).get("decode", {}).get("tp", 1)
    try:
        server.wait_ready()
        yield server
    finally:
        stop_later(server)


def test_a_frontier_model_is_served_as_the_engine_answers(frontier_server) -> None:
    """A hybrid (its state in the replica's pool) or a sparse-attention model through the real server: two
    chats at once, streamed, get the in-process engine's answers; /metrics counts them."""
    import concurrent.futures

    client = openai.OpenAI(base_url=frontier_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    expected = build(frontier_server.model).generate(
        [{"messages": [{"role": "user", "content": p}], "params": greedy(12, ignore_eos=True)} for p in PROMPTS])

    def stream(prompt: str) -> str:
        chunks = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=12, temperature=0, extra_body={"ignore_eos": True},
                                                stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(stream, PROMPTS)) == [e.text for e in expected]
    metrics = httpx.get(frontier_server.base_url + "/metrics", timeout=30).text
    assert "vllm:generation_tokens" in metrics
    assert httpx.get(frontier_server.base_url + "/strata/stats", timeout=30).json()["decode"]["tp"] == frontier_server.decode_tp

"""Tool calling in-process: each family's syntax read whole and streamed (the deltas add up to the whole
message, however the text is cut), requests' tools and tool_choice checked, the format read off a chat
template; then the engine, per family, on a tiny checkpoint whose template renders tools: ``required`` and
a named function give calls that parse and satisfy the schemas, ``auto`` gives text or (steered by a
logit bias onto the opening marker) one well-formed call; special-token markers survive detokenizing and
the end-of-sequence token does not. Real weights: SmolLM2 with a tools template calls get_weather for
Paris, and answers from the tool's result."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from helpers import build, greedy, tokens_through_handoff

from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.frontend.tools.calls import ToolCallDeltas, constrain, tool_calls_message
from strata.pipeline.frontend.tools.formats import TOOL_FORMATS, detect_tool_format, tool_format_for
from strata.pipeline.frontend.tools.request import tool_request
from strata.checkpoints.tiny_text_models import build_tiny_text_model
from strata.checkpoints.tiny_tool_templates import TOOL_TEMPLATES

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}}, "required": ["city"],
           "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}

# two calls in each family's syntax, with text before them where the family allows it
ANSWERS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22}}\n</tool_call>', "Let me check."),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "add", "parameters": {"a": 1, "b": 22}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 22}}]', None),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>'
                '{"a": 1, "b": 22}<|tool_call_end|><|tool_calls_section_end|>', None),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n'
                    '```json\n{"a": 1, "b": 22}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None),
    "minimax_m2": ('Let me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
                   '</parameter>\n</invoke>\n<invoke name="add">\n<parameter name="a">1</parameter>\n'
                   '<parameter name="b">22</parameter>\n</invoke>\n</minimax:tool_call>', "Let me check."),
    "glm45": ('Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
              '</tool_call>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n'
              '<arg_value>22</arg_value>\n</tool_call>', "Let me check."),
    "deepseek_v32": ('Let me check.\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter '
                     'name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name="add">\n'
                     '<｜DSML｜parameter name="a" string="false">1</｜DSML｜parameter>\n<｜DSML｜parameter name="b" '
                     'string="false">22</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>', "Let me check."),
    "qwen3_coder": ('Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n'
                    '</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n'
                    '<parameter=b>\n22\n</parameter>\n</function>\n</tool_call>', "Let me check."),
    # gpt-oss: its analysis is no content; each call a message addressed to the function
    "openai": ("<|channel|>analysis<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|><|start|>assistant'
               '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 22}<|call|>', None),
}
EXPECTED = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 22})]


@pytest.fixture(scope="module")
def tool_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tool-models")
    return {family: build_tiny_text_model("qwen2", root / family, tool_format=family) for family in TOOL_TEMPLATES}


@pytest.fixture(scope="module")
def tokenizers(tool_models: dict[str, Path]) -> dict:
    from transformers import AutoTokenizer

    return {family: AutoTokenizer.from_pretrained(str(path)) for family, path in tool_models.items()}


def _streamed(fmt, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """Content and calls as a client assembles them from the deltas of ``text`` arriving cut at ``cuts``."""
    deltas, content, calls = ToolCallDeltas(fmt), "", []
    ends = [*cuts, len(text)]
    for end in ends:
        delta = deltas.update(text[:end], final=end == len(text)) or {}
        content += delta.get("content", "")
        for entry in delta.get("tool_calls", []):
            if "id" in entry:
                assert entry["index"] == len(calls) and entry["type"] == "function"
                calls.append({"id": entry["id"], "name": entry["function"]["name"], "arguments": ""})
            calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("family", sorted(ANSWERS))
def test_each_family_is_read_whole_and_streamed_alike(family: str, tokenizers: dict) -> None:
    fmt = TOOL_FORMATS[family](tokenizers[family])
    text, content = ANSWERS[family]
    whole_content, calls = tool_calls_message(fmt, text)
    assert whole_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == EXPECTED
    assert all(c["type"] == "function" and c["id"] for c in calls)
    for cuts in (list(range(1, len(text))), [len(text) // 3, len(text) // 2], []):  # every character; chunks; whole
        streamed_content, streamed = _streamed(fmt, text, cuts)
        assert streamed_content == (content or "")
        assert [(c["name"], c["arguments"]) for c in streamed] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_text_without_calls_is_content_and_a_stream_holds_back_only_a_possible_marker(tokenizers: dict) -> None:
    fmt = TOOL_FORMATS["hermes"](tokenizers["hermes"])
    assert tool_calls_message(fmt, "Just text, <b>bold</b>.") == ("Just text, <b>bold</b>.", [])
    deltas = ToolCallDeltas(fmt)
    assert deltas.update("Hi <tool_c") == {"content": "Hi"}  # "<tool_c" may open a call: held back
    assert deltas.update("Hi <tool_c!", final=True) == {"content": " <tool_c!"}
    assert not deltas.has_calls


def test_a_cut_call_keeps_what_was_written_and_a_nameless_one_stays_text(tokenizers: dict) -> None:
    fmt = TOOL_FORMATS["hermes"](tokenizers["hermes"])
    content, calls = tool_calls_message(fmt, '<tool_call>\n{"name": "add", "arguments": {"a": 4')
    assert content is None and calls[0]["function"] == {"name": "add", "arguments": '{"a": 4'}
    assert tool_calls_message(fmt, '<tool_call>\n{"nam') == ('<tool_call>\n{"nam', [])
    # arguments written as a JSON string (some models do) are its text
    _, calls = tool_calls_message(fmt, '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"a": 1}'


TYPED = {  # a call whose string parameter holds "123", in each family that types values by the request's schemas
    "minimax_m2": ('<minimax:tool_call>\n<invoke name="lookup">\n<parameter name="code">123</parameter>\n<parameter '
                   'name="n">5</parameter>\n<parameter name="tags">["a", "b <c>"]</parameter>\n</invoke>\n'
                   '</minimax:tool_call>', "5</parameter>"),
    "glm45": ('<tool_call>lookup\n<arg_key>code</arg_key>\n<arg_value>123</arg_value>\n<arg_key>n</arg_key>\n'
              '<arg_value>5</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>["a", "b <c>"]</arg_value>\n</tool_call>',
              "5</arg_value>"),
    "qwen3_coder": ('<tool_call>\n<function=lookup>\n<parameter=code>\n123\n</parameter>\n<parameter=n>\n5\n'
                    '</parameter>\n<parameter=tags>\n["a", "b <c>"]\n</parameter>\n</function>\n</tool_call>',
                    "5\n</parameter>"),
}


@pytest.mark.parametrize("family", sorted(TYPED))
def test_values_are_read_by_the_declared_parameter_types(family: str, tokenizers: dict) -> None:
    """MiniMax-M2, GLM and Qwen3.5 write a string parameter as bare text and any other as JSON, so "123" is a string for
    a string parameter and a number for an integer one: the request's schemas decide, and unbound the JSON
    reading is a guess. A call cut inside a parameter has only its whole parameters."""
    fmt = TOOL_FORMATS[family](tokenizers[family])
    schema = {"type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}}}
    text, cut_at = TYPED[family]
    bound = fmt.for_request(tool_request([{"type": "function", "function": {"name": "lookup", "parameters": schema}}],
                                         None, None))
    assert _named(bound, text) == [("lookup", {"code": "123", "n": 5, "tags": ["a", "b <c>"]})]
    assert _named(fmt, text) == [("lookup", {"code": 123, "n": 5, "tags": ["a", "b <c>"]})]
    cut = text[:text.index(cut_at)]
    assert tool_calls_message(bound, cut)[1][0]["function"]["arguments"] == '{"code": "123"'


def test_deepseek_v32_values_are_typed_by_their_string_attribute(tokenizers: dict) -> None:
    """DSML says per value whether it is text: "123" under string="true" is a string even where the schema
    says integer (what the model wrote), under string="false" JSON, and with no attribute the schema decides."""
    fmt = TOOL_FORMATS["deepseek_v32"](tokenizers["deepseek_v32"])
    schema = {"type": "object", "properties": {"code": {"type": "integer"}, "n": {"type": "string"},
                                               "m": {"type": "integer"}}}
    text = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="lookup">\n<｜DSML｜parameter name="code" string="true">123'
            '</｜DSML｜parameter>\n<｜DSML｜parameter name="n" string="false">5</｜DSML｜parameter>\n<｜DSML｜parameter '
            'name="m">7</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    bound = fmt.for_request(tool_request([{"type": "function", "function": {"name": "lookup", "parameters": schema}}],
                                         None, None))
    assert _named(bound, text) == [("lookup", {"code": "123", "n": 5, "m": 7})]


@pytest.mark.parametrize("tools, choice, parallel, message", [
    ([{"type": "retrieval"}], None, None, "tools[0] must be"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, None, "tools[0].function.name"),
    ([TOOLS[0], TOOLS[0]], None, None, "unique"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, None, "parameters"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "'nope', which is not among"),
    (TOOLS, "sometimes", None, "tool_choice must be"),
    (None, "required", None, "tool_choice needs tools"),
    (TOOLS, "auto", "yes", "parallel_tool_calls"),
    ([TOOLS[0]] * 129, None, None, "at most 128"),
])
def test_bad_tools_are_refused_by_name(tools, choice, parallel, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        tool_request(tools, choice, parallel)


def test_tool_choice_defaults_and_named_calls() -> None:
    assert tool_request(None, None, None) is None and tool_request([], "none", None) is None
    auto = tool_request(TOOLS, None, None)
    assert auto.choice == "auto" and auto.parallel and auto.parses_calls
    assert not tool_request(TOOLS, "none", None).parses_calls
    named = tool_request(TOOLS, {"type": "function", "function": {"name": "add"}}, None)
    assert [f.name for f in named.callable_functions()] == ["add"] and not named.parallel
    assert named.template_tools() == TOOLS  # the template still sees every tool


def test_the_format_is_read_off_the_chat_template(tokenizers: dict) -> None:
    for family, tok in tokenizers.items():
        assert detect_tool_format(tok.chat_template) == family
        assert tool_format_for("auto", tok).name == family
    assert detect_tool_format("{{ messages[0]['content'] }}") is None  # renders no tools
    assert tool_format_for("none", tokenizers["hermes"]) is None
    assert tool_format_for("mistral", tokenizers["hermes"]).name == "mistral"  # named: taken as said
    from typing import get_args

    from strata.deployments.ray_serve.config import ServeConfig
    allowed = set(get_args(ServeConfig.model_fields["tool_call_parser"].annotation))
    assert allowed == {"auto", "none", *TOOL_FORMATS}  # the config offers every parser there is


def _run(engine, fmt, tools_request, max_tokens: int = 200, **params):  # DSML takes ~150 tiny tokens
    p = greedy(max_tokens, **params)
    constrain(p, tools_request, fmt)
    return engine.generate([{"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                             "params": p, "tools": tools_request.template_tools()}])[0]


def _calls(fmt, text: str) -> list[tuple[str, dict]]:
    _, calls = tool_calls_message(fmt, text)
    out = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    for name, arguments in out:
        jsonschema.validate(arguments, SCHEMAS[name])
    return out


@pytest.mark.parametrize("family", sorted(TOOL_TEMPLATES))
def test_required_and_named_calls_parse_and_satisfy_the_schemas(family: str, tool_models: dict) -> None:
    engine = build(tool_models[family])
    fmt = tool_format_for("auto", engine.intake.tokenizer.tokenizer)
    out = _run(engine, fmt, tool_request(TOOLS, "required", False))
    assert out.finish_reason == "stop" and len(_calls(fmt, out.text)) == 1
    named = _run(engine, fmt, tool_request(TOOLS, {"type": "function", "function": {"name": "add"}}, None))
    assert named.finish_reason == "stop" and [name for name, _ in _calls(fmt, named.text)] == ["add"]
    if family in ("llama3_json", "openai"):
        return  # llama3's calls open with "{": no marker token to steer onto; harmony's auto is read, not enforced
    text_only = _run(engine, fmt, tool_request(TOOLS, "auto", False), max_tokens=24)
    assert _calls(fmt, text_only.text) == []  # a random model writes text; auto leaves it text
    steered = _run(engine, fmt, tool_request(TOOLS, "auto", False), logit_bias={fmt.token_ids[fmt.start]: 100.0})
    assert steered.finish_reason == "stop" and len(_calls(fmt, steered.text)) == 1


def test_auto_with_a_one_token_marker_leaves_text_alone_and_calls_start_at_it(tool_models: dict) -> None:
    """A one-token opening marker is the grammar's trigger: text before it is the model's own, token for
    token (no mask; the random model writes invalid UTF-8 a text grammar would refuse), and the call
    grammar starts at it, also for requests preempted and computed again."""
    engine = build(tool_models["hermes"])
    fmt = tool_format_for("auto", engine.intake.tokenizer.tokenizer)
    marker = fmt.token_ids[fmt.start]
    p = greedy(24, ignore_eos=True, logit_bias={marker: -100.0})
    constrain(p, tool_request(TOOLS, "auto", None), fmt)
    assert p.structured_trigger == marker
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    auto = engine.generate([{"messages": messages, "params": p, "tools": TOOLS}])[0]
    plain = engine.generate([{"messages": messages, "params": greedy(24, ignore_eos=True, logit_bias={marker: -100.0}),
                              "tools": TOOLS}])[0]
    assert auto.output_token_ids == plain.output_token_ids

    def steered(i: int) -> dict:
        params = greedy(64, logit_bias={marker: 100.0})
        constrain(params, tool_request(TOOLS, "auto", False), fmt)
        return {"messages": [{"role": "user", "content": f"Request {i}: the weather in Paris and the sum of 2 and 3?"}],
                "params": params, "tools": TOOLS}
    alone = [engine.generate([steered(i)])[0].text for i in range(4)]
    # preempting_engine's pool, sized for these longer prompts (the tools are rendered into each)
    squeezed = build(tool_models["hermes"], num_kv_blocks=64, max_num_batched_tokens=64, prefill_chunk_tokens=32,
                     enable_prefix_caching=False)
    outs = squeezed.generate([steered(i) for i in range(4)])
    assert [o.text for o in outs] == alone and squeezed.scheduler.num_preemptions > 0
    assert all(len(_calls(fmt, text)) == 1 for text in alone)


def test_a_triggered_call_continues_across_a_prefill_to_decode_hand_off(tool_models: dict, tmp_path: Path) -> None:
    """Prefill samples the marker (its first token); decode, in another engine, starts the call's grammar from
    it: the same tokens as one engine."""
    model = tool_models["kimi_k2"]
    engine = build(model)
    fmt = tool_format_for("auto", engine.intake.tokenizer.tokenizer)
    params = greedy(40, logit_bias={fmt.token_ids[fmt.start]: 100.0})
    constrain(params, tool_request(TOOLS, "auto", False), fmt)
    whole = engine.generate([{"prompt": "Weather in Oslo?", "params": params}])[0]
    assert len(_calls(fmt, whole.text)) == 1
    config = EngineConfig(host_kv_blocks=64, host_kv_dir=str(tmp_path / "host"))
    assert tokens_through_handoff(model, config, engine, [], "Weather in Oslo?", params) == whole.output_token_ids


def test_special_token_markers_are_text_and_the_end_token_is_not(tool_models: dict) -> None:
    engine = build(tool_models["kimi_k2"])
    fmt = tool_format_for("auto", engine.intake.tokenizer.tokenizer)
    assert fmt.keeps_special_tokens
    out = _run(engine, fmt, tool_request(TOOLS, "required", False))
    assert out.text.startswith("<|tool_calls_section_begin|><|tool_call_begin|>functions.")
    eos = engine.intake.tokenizer.eos_token_ids[0]
    ended = engine.generate([{"prompt": "hi", "params": greedy(8, skip_special_tokens=False,
                                                                logit_bias={eos: 100.0})}])[0]
    assert ended.output_token_ids == [eos] and ended.text == "" and ended.finish_reason == "stop"


def test_tools_and_earlier_calls_are_rendered_by_the_template(tool_models: dict) -> None:
    engine = build(tool_models["hermes"])
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "snow"}]
    text = engine.intake.tokenizer.render_chat(messages, tools=TOOLS)
    assert '"name": "get_weather"' in text and '{"city": "Oslo"}' in text and "tool: snow" in text
    assert json.dumps(TOOLS[1]) in text


def test_real_weights_call_a_tool_and_answer_from_its_result(smollm2: Path) -> None:
    """SmolLM2-135M-Instruct, with a template that renders tools in Hermes style (tests/data), asked about
    the weather in Paris: ``required`` gives get_weather(city="Paris"); ``auto`` lets it answer in text, token
    for token what it writes with no tools (the auto grammar constrains a call once begun, nothing before);
    given the tool's result, it answers from it. Its own template renders no tools: no format is found."""
    engine = build(smollm2)
    assert tool_format_for("auto", engine.intake.tokenizer.tokenizer) is None
    engine.intake.tokenizer.tokenizer.chat_template = (Path(__file__).parent / "data" / "smollm2_tools.jinja").read_text()
    fmt = tool_format_for("auto", engine.intake.tokenizer.tokenizer)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                              "required": ["city"], "additionalProperties": False}}}]
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    params = greedy(40)
    constrain(params, tool_request(tools, "required", False), fmt)
    out = engine.generate([{"messages": messages, "params": params, "tools": tools}])[0]
    assert _named(fmt, out.text) == [("get_weather", {"city": "Paris"})]
    params = greedy(30)
    constrain(params, tool_request(tools, "auto", None), fmt)
    auto = engine.generate([{"messages": messages, "params": params, "tools": tools}])[0]
    plain = engine.generate([{"messages": messages, "params": greedy(30), "tools": tools}])[0]
    assert auto.output_token_ids == plain.output_token_ids and "<tool_call>" not in plain.text
    messages += [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    params = greedy(40)
    constrain(params, tool_request(tools, "auto", None), fmt)
    answer = engine.generate([{"messages": messages, "params": params, "tools": tools}])[0]
    assert tool_calls_message(fmt, answer.text)[1] == [] and "sunny" in answer.text


def _named(fmt, text: str) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls_message(fmt, text)[1]]


def test_a_response_format_stays_with_auto_and_conflicts_with_required(tokenizers: dict) -> None:
    fmt = TOOL_FORMATS["hermes"](tokenizers["hermes"])
    params = greedy(8, structured=("json", '{"type": "object"}'))
    constrain(params, tool_request(TOOLS, "auto", None), fmt)
    assert params.structured == ("json", '{"type": "object"}') and params.structured_trigger is None
    with pytest.raises(ValueError, match="cannot be combined with response_format"):
        constrain(greedy(8, structured=("json", "{}")), tool_request(TOOLS, "required", None), fmt)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        constrain(greedy(8), tool_request(TOOLS, "auto", None), None)

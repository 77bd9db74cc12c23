"""Reasoning output: a model's thinking read apart from its answer, in-process. Each parser's split of a
whole answer and of the same answer streamed, cut anywhere, agree (a tag cut at a chunk's end is held back);
thinking off, or an answer cut inside the thinking, are what they are; a tool call right after the thinking
is found; the parser is read off the chat template. Then the ingress's responses (``Responder`` over scripted
token events): ``reasoning_content`` and ``reasoning`` apart from ``content``, whole and streamed, each chunk
valid against OpenAI's published stream schema."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from test_tool_call_responses import REQ, _chunks, _kids, _responder, _start, _validator

from strata.pipeline.frontend.answer import AnswerFormat
from strata.pipeline.frontend.reasoning import REASONING_FORMATS, ThinkTags, reasoning_format_for
from strata.pipeline.frontend.tools.formats import Hermes

QWEN3 = REASONING_FORMATS["qwen3"]
R1 = REASONING_FORMATS["deepseek_r1"]
HARMONY = REASONING_FORMATS["openai_gptoss"]
ANALYSIS = "<|channel|>analysis<|message|>User asks a capital.<|end|>"
CASES = [  # (format, output, reasoning, content)
    (QWEN3, "<think>\nParis is in France.\n</think>\n\nParis.", "\nParis is in France.\n", "Paris."),
    (QWEN3, "Paris.", None, "Paris."),  # thinking off: the template wrote the empty block itself
    (QWEN3, "<think>\nstill thinking", "\nstill thinking", None),  # cut by max_tokens inside the thinking
    (QWEN3, "<b>bold</b> <thinking", None, "<b>bold</b> <thinking"),
    (R1, "Paris is in France.</think>Paris.", "Paris is in France.", "Paris."),  # the prompt opened the block
    (R1, "<think>x</think>y", "x", "y"),
    (R1, "all thinking, no answer", "all thinking, no answer", None),
    # gpt-oss: the analysis channel, then the final one (its <|return|> ends the answer and is no text)
    (HARMONY, ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Paris.", "User asks a capital.", "Paris."),
    (HARMONY, "<|channel|>final<|message|>Paris.", None, "Paris."),
    (HARMONY, ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>"
              '{"q": 1}', "User asks a capital.", None),  # a tool's message is neither
    (HARMONY, ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Looking it up.<|end|>",
     "User asks a capital.", "Looking it up."),  # a preamble to no one is the answer
    (HARMONY, "plain text, no harmony", None, "plain text, no harmony"),
]


def _streamed(fmt: AnswerFormat, text: str, cuts: list[int]) -> dict[str, str]:
    deltas, got = fmt.deltas(), {"reasoning_content": "", "reasoning": "", "content": ""}
    for end in [*cuts, len(text)]:
        for key, value in (deltas.update(text[:end], final=end == len(text)) or {}).items():
            if key in got:
                got[key] += value
    return got


@pytest.mark.parametrize("fmt, text, reasoning, content", CASES)
def test_each_answer_splits_alike_whole_and_streamed(fmt: ThinkTags, text: str, reasoning, content) -> None:
    choice = AnswerFormat(fmt).read({"message": {"content": text}, "finish_reason": "stop"})
    assert choice["message"].get("reasoning_content") == reasoning and choice["message"]["content"] == content
    assert choice["message"].get("reasoning") == reasoning
    for cuts in (list(range(1, len(text))), [len(text) // 2], []):
        got = _streamed(AnswerFormat(fmt), text, cuts)
        assert got["reasoning_content"] == got["reasoning"] == (reasoning or "") and got["content"] == (content or "")


def test_a_closing_tag_cut_at_a_chunks_end_is_held_back() -> None:
    deltas = AnswerFormat(QWEN3).deltas()
    assert deltas.update("<thi") is None  # may open the thinking: nothing is sent yet
    assert deltas.update("<think>plan</th") == {"reasoning_content": "plan", "reasoning": "plan"}
    assert deltas.update("<think>plan</think>\n\nGo") == {"content": "Go"}


def test_a_tool_call_right_after_the_thinking_is_a_call() -> None:
    fmt = AnswerFormat(QWEN3, Hermes(SimpleNamespace(added_tokens_decoder={})))
    text = '<think>I need the sum.</think>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    choice = fmt.read({"message": {"content": text}, "finish_reason": "stop"})
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "I need the sum."
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    deltas, arguments, thinking = fmt.deltas(), "", ""
    for end in range(1, len(text) + 1):
        delta = deltas.update(text[:end], final=end == len(text)) or {}
        thinking += delta.get("reasoning_content", "")
        assert "content" not in delta
        arguments += "".join(p["function"]["arguments"] for p in delta.get("tool_calls", []))
    assert thinking == "I need the sum." and arguments == '{"a": 1}'


def test_a_call_forced_from_the_first_token_is_the_answer_though_the_prompt_opened_the_thinking() -> None:
    """``tool_choice`` required makes the model call at once: with a template that opened the thinking, the
    call is still a call, whole and streamed (the marker's first characters are held back, not sent as thinking)."""
    fmt = AnswerFormat(R1, Hermes(SimpleNamespace(added_tokens_decoder={})))
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    choice = fmt.read({"message": {"content": text}, "finish_reason": "stop"})
    assert "reasoning_content" not in choice["message"] and choice["finish_reason"] == "tool_calls"
    deltas, arguments = fmt.deltas(), ""
    for end in range(1, len(text) + 1):
        delta = deltas.update(text[:end], final=end == len(text)) or {}
        assert "reasoning_content" not in delta and "content" not in delta
        arguments += "".join(p["function"]["arguments"] for p in delta.get("tool_calls", []))
    assert arguments == '{"a": 1}'
    assert AnswerFormat(R1, fmt.tools).read({"message": {"content": "plan</think>ok"}, "finish_reason": "stop"}
                                            )["message"]["reasoning_content"] == "plan"


def test_gpt_oss_thinks_then_calls_and_both_are_read_whole_and_streamed() -> None:
    """Harmony: the analysis is the reasoning and a message addressed to a function is a call (read out of the
    whole output, which the reasoning split leaves out of the answer); cut anywhere, the stream adds up."""
    from strata.pipeline.frontend.tools.calls import constrain
    from strata.pipeline.frontend.tools.formats import HarmonyCalls
    from strata.pipeline.frontend.tools.request import tool_request
    from strata.pipeline.contract.sampling_params import SamplingParams

    from tokenizers import AddedToken

    markers = {200_000 + i: AddedToken(m, special=True) for i, m in enumerate(HarmonyCalls.markers)}
    calls = HarmonyCalls(SimpleNamespace(added_tokens_decoder=markers))  # special tokens, as gpt-oss's are
    fmt = AnswerFormat(HARMONY, calls)
    text = (ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
            '{"a": 1, "b": 2}<|call|>')
    choice = fmt.read({"message": {"content": text}, "finish_reason": "stop"})
    message = choice["message"]
    assert message["reasoning_content"] == "User asks a capital." and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert choice["finish_reason"] == "tool_calls"
    deltas, thinking, arguments = fmt.deltas(), "", ""
    for end in range(1, len(text) + 1):
        delta = deltas.update(text[:end], final=end == len(text)) or {}
        assert "content" not in delta
        thinking += delta.get("reasoning_content", "")
        arguments += "".join(p["function"]["arguments"] for p in delta.get("tool_calls", []))
    assert thinking == "User asks a capital." and arguments == '{"a": 1, "b": 2}'
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    auto = SamplingParams(max_tokens=8)
    constrain(auto, tool_request(tools, "auto", None), calls)  # read as written: no grammar, markers kept
    assert auto.structured is None and auto.skip_special_tokens is False
    required = SamplingParams(max_tokens=8)
    constrain(required, tool_request(tools, "required", None), calls)
    assert required.structured[0] == "lark" and '"commentary to=functions.add "' in required.structured[1]


class _Template(SimpleNamespace):
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "user: hi\nassistant:" + self.opens


def test_the_parser_is_read_off_the_chat_template() -> None:
    think = "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    opened = reasoning_format_for("auto", _Template(chat_template=think + "<think>\n", opens=" <think>\n"))
    assert opened is not None and opened.opened_by_prompt
    written = reasoning_format_for("auto", _Template(chat_template=think, opens=""))
    assert written is not None and not written.opened_by_prompt
    assert reasoning_format_for("auto", _Template(chat_template="{{ messages }}", opens="")) is None
    assert reasoning_format_for("none", _Template(chat_template=think, opens="")) is None
    assert reasoning_format_for("auto", _Template(chat_template="<|start|>{{ m }}<|channel|>final", opens="")) is HARMONY
    assert reasoning_format_for("deepseek_r1", None) is R1
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        reasoning_format_for("o1", None)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_responses_carry_reasoning_apart_from_content(stream: bool) -> None:
    pieces = ["<think>", "Paris is ", "in France.</th", "ink>\n\nParis", "."]
    responder, prepared, fmt = _responder(), _kids(1)[0], AnswerFormat(QWEN3)
    if not stream:
        body = json.loads(asyncio.run(responder.whole(REQ, prepared, _start(pieces)(prepared), True,
                                                      time.perf_counter(), fmt)).body)
        _validator("CreateChatCompletionResponse").validate(body)
        message = body["choices"][0]["message"]
        assert (message["reasoning_content"], message["reasoning"], message["content"]) == \
            ("Paris is in France.", "Paris is in France.", "Paris.")
        return
    chunks = _chunks(lambda: responder.stream(REQ, prepared, _start(pieces)(prepared), True, time.perf_counter(), fmt))
    got = {"reasoning_content": "", "reasoning": "", "content": ""}
    for chunk in chunks:
        _validator("CreateChatCompletionStreamResponse").validate(chunk)
        for key in got:
            got[key] += chunk["choices"][0]["delta"].get(key) or "" if chunk["choices"] else ""
    assert got == {"reasoning_content": "Paris is in France.", "reasoning": "Paris is in France.", "content": "Paris."}


def test_a_response_formats_grammar_starts_after_the_thinking(tmp_path) -> None:
    """A guided_choice with a trigger outside the grammar (the thinking's end tag): the thinking is free, the
    tag is not fed to the grammar, the answer is a choice; across a prefill-to-decode hand-off the decode
    engine's matcher starts after the tag the prefill sampled. The trigger is the end tag only while the
    prompt left the thinking to come or open."""
    from helpers import build, greedy, tokens_through_handoff

    from strata.checkpoints.tiny_text_models import build_tiny_text_model
    from strata.pipeline.contract.config import EngineConfig
    from strata.pipeline.frontend.structured import spec_from_openai

    model = build_tiny_text_model("minimax_m2", tmp_path / "model", tool_format="minimax_m2")
    engine = build(model)
    hf = engine.intake.tokenizer.tokenizer
    start, end = hf.convert_tokens_to_ids("<think>"), hf.convert_tokens_to_ids("</think>")
    tags = ThinkTags("minimax_m2")
    assert tags.answer_trigger([5, start, 9], hf) == end  # open: the answer comes after the tag
    assert tags.answer_trigger([5, 9], hf) == end  # to come (the model opens it itself)
    assert tags.answer_trigger([start, 9, end, 7], hf) is None  # closed last (thinking off): constrain at once
    params = greedy(12, logit_bias={end: 100.0})
    params.structured = spec_from_openai({"guided_choice": ["yes", "no"]})
    params.structured_trigger, params.structured_trigger_in_grammar = end, False
    whole = engine.generate([{"prompt": "Is the sky blue?", "params": params}])[0]
    assert whole.output_token_ids[0] == end and whole.finish_reason == "stop"
    assert hf.decode(whole.output_token_ids[1:], skip_special_tokens=True) in ("yes", "no")
    config = EngineConfig(host_kv_blocks=64, host_kv_dir=str(tmp_path / "host"))
    assert tokens_through_handoff(model, config, engine, [], "Is the sky blue?", params) == whole.output_token_ids

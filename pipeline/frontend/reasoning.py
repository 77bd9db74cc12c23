"""Reasoning output: the thinking a model writes before its answer, read apart from the answer.

DeepSeek-R1, Qwen3, GLM-4.5, Kimi-K2-Thinking and MiniMax-M2 write their thinking between ``<think>`` and
``</think>``, then the answer (``ThinkTags``); gpt-oss writes harmony messages on channels (``Harmony``). Where
the template's generation prompt already opened the block (DeepSeek-R1's
``<think>\\n``), the output starts inside it; otherwise it starts with the opening tag, or without one when
the request turned thinking off (Qwen3's ``enable_thinking``: the template wrote an empty block itself), and
then it is all answer. Names are vLLM's ``--reasoning-parser`` names.

``split`` reads a possibly unfinished output, so one code serves whole answers and streams: the reasoning
and the answer as far as they can no longer change (a tag cut at the end is held back), each a prefix of
what the finished output gives, so a stream's deltas add up to the whole message. The answer is what
tool-call parsing then reads: a call made right after the thinking is found there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.pipeline.frontend.harmony import MESSAGE, harmony_messages
from strata.pipeline.frontend.stream_text import held_back
from strata.pipeline.frontend.template_bounds import render_bounded


@dataclass(frozen=True)
class ThinkTags:
    """Thinking between two tags, then the answer."""

    name: str
    opened_by_prompt: bool = False  # the generation prompt ends inside the block (no opening tag is written)
    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, answer) of ``text`` as far as they are settled; reasoning None when there is none."""
        body = text.lstrip()
        if body.startswith(self.start):  # written, though the prompt may have opened the block already
            body = body[len(self.start):]
        elif not final and self.start.startswith(body):  # the opening tag may be on its way
            return ("" if self.opened_by_prompt else None), ""
        elif not self.opened_by_prompt:
            return None, text
        thinking, closed, answer = body.partition(self.end)
        if not closed:
            return (thinking if final else held_back(thinking, self.end)), ""
        return thinking, answer.lstrip()

    def answer_trigger(self, prompt_ids: list[int], hf_tokenizer: Any) -> int | None:
        """The token after which the answer (and so a response format's grammar) starts: the end tag, while
        the thinking is still to come or open. None when the prompt closed it last (``enable_thinking:
        false`` writes an empty block; vLLM likewise counts the thinking over once its end tag is in the
        prompt), or when a tag is not one token of this vocabulary. A model that never writes the end tag
        is never constrained, as in vLLM."""
        start, end = (_single_token(hf_tokenizer, tag) for tag in (self.start, self.end))
        if start is None or end is None:
            return None
        last = {tok: i for i, tok in enumerate(prompt_ids) if tok in (start, end)}
        return None if last.get(end, -1) > last.get(start, -1) else end


@dataclass(frozen=True)
class Harmony:
    """gpt-oss's harmony messages (``harmony``): ``<|channel|>analysis<|message|>THINKING<|end|><|start|>assistant
    <|channel|>final<|message|>ANSWER``. The analysis channel is the reasoning; the final channel, and commentary
    addressed to no one (a preamble), is the answer; a message addressed to a tool (``to=functions.NAME``) is
    neither (``tools.harmony_format.HarmonyCalls`` reads it). Its markers are special tokens, so the answer is
    detokenized with them kept (``needs_special_tokens``); a message whose header is still being written adds
    nothing yet."""

    name: str = "openai_gptoss"
    opened_by_prompt: bool = False
    needs_special_tokens: bool = True

    def answer_trigger(self, prompt_ids: list[int], hf_tokenizer: Any) -> int | None:
        """None: the final channel opens with several tokens, so a grammar applies from the first token."""
        return None

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        if MESSAGE not in text:  # not harmony at all, or a first header on its way
            return None, text if final else ""
        thinking: list[str] | None = None
        answer: list[str] = []
        for message in harmony_messages(text, final):
            if message.recipient is not None:
                continue
            if message.channel == "analysis":
                thinking = (thinking or []) + [message.body]
            else:
                answer.append(message.body)
        return ("".join(thinking) if thinking is not None else None), "".join(answer)


ReasoningFormat = ThinkTags | Harmony


def _single_token(hf_tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when the vocabulary holds it as one token, else None."""
    token_id = hf_tokenizer.convert_tokens_to_ids(text)
    if not isinstance(token_id, int) or hf_tokenizer.convert_ids_to_tokens(token_id) != text:
        return None
    return token_id
REASONING_FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (
    ThinkTags("deepseek_r1", opened_by_prompt=True), ThinkTags("qwen3"), ThinkTags("glm45"), ThinkTags("kimi_k2"),
    ThinkTags("minimax_m2"), Harmony())}


def reasoning_format_for(parser: str, hf_tokenizer: Any) -> ReasoningFormat | None:
    """The reasoning format a server reads: ``parser`` names one; ``auto`` reads it off the chat template
    (harmony's ``<|channel|>``, or ``<think>``: whether its generation prompt opens the block is found by
    rendering it);
    ``none`` turns it off."""
    if parser == "none":
        return None
    if parser != "auto":
        if parser not in REASONING_FORMATS:
            raise ValueError(f"unknown reasoning parser {parser!r}; expected auto, none or one of "
                             f"{', '.join(REASONING_FORMATS)}")
        return REASONING_FORMATS[parser]
    template = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(template, str) and "<|channel|>" in template:
        return REASONING_FORMATS["openai_gptoss"]
    if not isinstance(template, str) or "<think>" not in template:
        return None
    try:  # bounded as any render is: a template that runs away never holds a server's start
        prompt = render_bounded(lambda: hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True), 5.0, 1_000_000)
    except Exception:  # one that needs more than a user turn to render, or runs away: the tags decide alone
        prompt = ""
    opened = isinstance(prompt, str) and prompt.rstrip().endswith("<think>")
    return ThinkTags("auto", opened_by_prompt=opened)

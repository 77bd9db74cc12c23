"""A chat answer as the client receives it: its reasoning apart (``reasoning``), then its tool calls read out
of the rest (``tools``), whole or as a stream's deltas that add up to the whole message.

The reasoning goes out under both names OpenAI-compatible servers use: ``reasoning_content`` (DeepSeek's,
which most clients read) and ``reasoning`` (vLLM's newer one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.pipeline.frontend.reasoning import ReasoningFormat
from strata.pipeline.frontend.tools.calls import ToolCallDeltas, tool_calls_message
from strata.pipeline.frontend.tools.formats import ToolFormat


@dataclass(frozen=True)
class AnswerFormat:
    """How one request's answer is read: a reasoning format, a tool-call format (bound to its tools), or both."""

    reasoning: ReasoningFormat | None = None
    tools: ToolFormat | None = None

    def thinks(self, text: str, final: bool) -> bool | None:
        """Whether ``text`` is read for reasoning; None while that is not yet known. An answer that opens with
        the calls' marker is not, though the prompt opened the thinking: ``tool_choice`` required or a named
        function makes the model call at once, and the call is the answer."""
        if self.reasoning is None:
            return False
        if self.tools is None or not self.reasoning.opened_by_prompt:
            return True
        head, marker = text.lstrip(), self.tools.start
        if head.startswith(marker):
            return False
        return True if final or not marker.startswith(head) else None

    def read(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A whole chat choice with its answer read: ``reasoning_content`` / ``reasoning``, the content left,
        ``tool_calls`` and ``finish_reason`` ``tool_calls`` when the answer ended after making some."""
        message = choice["message"]
        text = whole = message["content"]
        if self.thinks(text, final=True):
            thinking, text = self.reasoning.split(text, final=True)  # type: ignore[union-attr]
            if thinking is not None:
                message["reasoning_content"] = message["reasoning"] = thinking
            message["content"] = (text or None) if thinking is not None else text
        if self.tools is not None:
            content, calls = tool_calls_message(self.tools, whole if self.tools.reads_whole_output else text)
            if calls:
                message["content"] = content
                message["tool_calls"] = calls
                if choice["finish_reason"] == "stop":
                    choice["finish_reason"] = "tool_calls"
        return choice

    def deltas(self) -> "AnswerDeltas":
        return AnswerDeltas(self)


class AnswerDeltas:
    """The deltas of one streamed answer: feed it the text so far, get what is new since the last call."""

    def __init__(self, fmt: AnswerFormat) -> None:
        self.fmt = fmt
        self.tools = ToolCallDeltas(fmt.tools) if fmt.tools is not None else None
        self.reasoning_sent = 0
        self.content_sent = 0

    @property
    def has_calls(self) -> bool:
        return self.tools is not None and self.tools.has_calls

    def update(self, text: str, final: bool = False) -> dict[str, Any] | None:
        """One delta (``reasoning_content`` and ``reasoning``, ``content``, ``tool_calls``) with what ``text``
        adds; None when nothing."""
        delta: dict[str, Any] = {}
        whole = text
        thinks = self.fmt.thinks(text, final)
        if thinks is None:  # a call's marker may be on its way
            return None
        if thinks:
            thinking, text = self.fmt.reasoning.split(text, final)  # type: ignore[union-attr]
            if thinking is not None and len(thinking) > self.reasoning_sent:
                delta["reasoning_content"] = delta["reasoning"] = thinking[self.reasoning_sent:]
                self.reasoning_sent = len(thinking)
        if self.tools is not None:
            delta.update(self.tools.update(whole if self.tools.fmt.reads_whole_output else text, final) or {})
        elif len(text) > self.content_sent:
            delta["content"] = text[self.content_sent:]
            self.content_sent = len(text)
        return delta or None

"""A request's tool calls, from sampling to OpenAI's shapes: the constraint that makes the model write
them well-formed (``constrain``), the whole message, and the deltas of a stream.

Both read the output with the family's parser (``formats``), so a stream's deltas add up to the whole
message: the same content, names and argument text. A stream sends each call's ``id``, ``type`` and name
once the name is fully written, then the arguments as they grow. Only calls whose name was written are
reported; an answer that opens a call and never names a function keeps its text as content (whole), as
vLLM does.
"""

from __future__ import annotations

import uuid
from typing import Any

from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.frontend.tools.formats import ParsedCall, ToolFormat
from strata.pipeline.frontend.tools.request import ToolRequest

NO_FORMAT = ("this model's chat template writes no tool calls in a format this server reads: start it with "
             "--tool-call-parser (and --chat-template for a template that renders tools)")


def constrain(params: SamplingParams, req: ToolRequest, fmt: ToolFormat | None) -> None:
    """Make ``params`` sample the answers the request allows: with ``required`` or a named function only
    calls, with ``auto`` text or calls; a call names a declared function, with arguments that satisfy its
    schema. A request that also sets its own structured output keeps it with ``auto`` (its calls are
    still read) and is refused otherwise. ValueError (an HTTP 400) says why."""
    if fmt is None:
        raise ValueError(NO_FORMAT)
    if params.structured is not None:
        if req.choice in ("required", "function"):
            raise ValueError("tool_choice required or a named function cannot be combined with response_format "
                             "or guided_* (both decide what the answer is)")
    elif req.choice == "auto" and not fmt.enforces_auto:
        pass  # calls are read as the model writes them (``HarmonyCalls``: no marker tells a call apart)
    elif req.choice == "auto" and fmt.start in fmt.token_ids:  # the calls' grammar, from the marker token on
        params.structured = ("lark", fmt.grammar(req, calls_only=True))
        params.structured_trigger = fmt.token_ids[fmt.start]
    else:
        params.structured = ("lark", fmt.grammar(req))
    if fmt.keeps_special_tokens:
        params.skip_special_tokens = False


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_message(fmt: ToolFormat, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished answer; content is None when the answer is only calls."""
    parsed = fmt.parse(text, final=True)
    calls = [c for c in parsed.calls if c.name is not None]
    if not calls:
        return text, []
    return parsed.content or None, [_call_entry(c, c.call_id or new_call_id()) for c in calls]


def _call_entry(call: ParsedCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ToolCallDeltas:
    """The deltas of one streamed answer: feed it the text so far, get what is new since the last call."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.content_sent = 0
        self.sent: list[tuple[str, int]] = []  # per call begun: (its id, argument characters sent)

    @property
    def has_calls(self) -> bool:
        return bool(self.sent)

    def update(self, text: str, final: bool = False) -> dict[str, Any] | None:
        """One delta (``content`` and/or ``tool_calls``) with what ``text`` adds; None when nothing."""
        parsed = self.fmt.parse(text, final)
        delta: dict[str, Any] = {}
        if len(parsed.content) > self.content_sent and not self.sent:
            delta["content"] = parsed.content[self.content_sent:]
            self.content_sent = len(parsed.content)
        entries = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if i == len(self.sent):
                call_id = call.call_id or new_call_id()
                self.sent.append((call_id, 0))
                entry: dict[str, Any] = {"index": i, "id": call_id, "type": "function",
                                         "function": {"name": call.name, "arguments": call.arguments}}
                self.sent[i] = (call_id, len(call.arguments))
                entries.append(entry)
            elif len(call.arguments) > self.sent[i][1]:
                entries.append({"index": i, "function": {"arguments": call.arguments[self.sent[i][1]:]}})
                self.sent[i] = (self.sent[i][0], len(call.arguments))
        if entries:
            delta["tool_calls"] = entries
        return delta or None

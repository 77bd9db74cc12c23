"""Families whose calls are JSON objects: ``hermes`` (``<tool_call>`` blocks), ``mistral`` (``[TOOL_CALLS]``
and an array) and ``llama3_json`` (the whole answer, calls joined by ``; ``)."""

from __future__ import annotations

from strata.pipeline.frontend.tools.format_base import (ParsedCall, ParsedOutput, ToolFormat, call_object,
                                                         call_sequence, json_call, json_schema_rule, stable_text)
from strata.pipeline.frontend.tools.json_scan import skip_ws
from strata.pipeline.frontend.tools.request import ToolFunction, ToolRequest


class Hermes(ToolFormat):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    markers = (start, end)
    signature = "<tool_call>"

    def _calls(self, rest: str) -> list[ParsedCall]:
        calls = []
        for block in rest.split(self.start):
            call = json_call(block, skip_ws(block, 0), ("arguments", "parameters"))
            if call is not None:
                calls.append(call)
        return calls

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        one = f'"\\n" call_json "\\n" {self.lit(self.end)}'
        more = f' ("\\n" {self.lit(self.start)} {one})*' if parallel else ""
        return [f"{one}{more}", "call_json: " + json_schema_rule(call_object(functions, "arguments"))]


class Mistral(ToolFormat):
    name = "mistral"
    start = "[TOOL_CALLS]"
    markers = (start,)
    signature = "[TOOL_CALLS]"

    def _calls(self, rest: str) -> list[ParsedCall]:
        i = skip_ws(rest, 0)
        if i >= len(rest) or rest[i] != "[":
            return []
        return call_sequence(rest, skip_ws(rest, i + 1), ",", ("arguments", "parameters"))

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        schema = {"type": "array", "items": call_object(functions, "arguments"), "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return ["calls_json", "calls_json: " + json_schema_rule(schema)]


class Llama3Json(ToolFormat):
    """No opening marker: an answer that is a JSON object (after an optional ``<|python_tag|>``) is calls."""

    name = "llama3_json"
    start = "<|python_tag|>"
    markers = ()  # <|python_tag|> is skipped with the other special tokens; the JSON is the signal
    signature = '"parameters"'

    def parse(self, text: str, final: bool) -> ParsedOutput:
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):].lstrip()
        if not body:
            return ParsedOutput(text if final else "")
        if not body.startswith("{"):
            return ParsedOutput(text if final else stable_text(text, ""))
        return ParsedOutput("", call_sequence(body, 0, ";", ("parameters", "arguments")))

    def grammar(self, req: ToolRequest, calls_only: bool = False) -> str:
        one = "call_json"
        calls = f'{one} ("; " {one})*' if req.parallel else one
        start = calls if calls_only or req.choice in ("required", "function") else f"FREE | {calls}"
        return "\n".join(["%llguidance {}", f"start: {start}", "FREE: /([^{](.|\\n)*)?/",
                          "call_json: " + json_schema_rule(call_object(req.callable_functions(), "parameters"))])

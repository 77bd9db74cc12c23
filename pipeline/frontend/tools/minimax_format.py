"""MiniMax-M2's XML-like calls (``minimax_m2``), read by the request's declared parameter types."""

from __future__ import annotations

import copy
import json
from typing import Any

from strata.pipeline.frontend.tools.format_base import TEXT_RULE, ParsedCall, ToolFormat, json_schema_rule
from strata.pipeline.frontend.tools.request import ToolFunction, ToolRequest


class MiniMaxM2(ToolFormat):
    """MiniMax-M2's calls, XML-like, one ``<invoke>`` per call and one ``<parameter>`` per argument:
    ``<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>\n...</invoke>\n...
    </minimax:tool_call>``. A value is the bare text for a string parameter, JSON for any other, so reading it
    takes the request's schemas (``for_request``); unbound, a value that parses as JSON other than a string is
    read as that. The arguments are written as JSON text a parameter at a time (``{"KEY": VALUE, ...}``, each
    step a prefix of the whole), so a stream's deltas add up to the whole answer's arguments."""

    name = "minimax_m2"
    start, end = "<minimax:tool_call>", "</minimax:tool_call>"
    invoke, invoke_end, parameter, parameter_end = '<invoke name="', "</invoke>", '<parameter name="', "</parameter>"
    markers = (start, end)
    signature = "<minimax:tool_call>"

    def __init__(self, hf_tokenizer: Any) -> None:
        super().__init__(hf_tokenizer)
        self.schemas: dict[str, dict[str, Any]] = {}  # function name -> its parameters schema (bound per request)

    def for_request(self, req: ToolRequest) -> "MiniMaxM2":
        bound = copy.copy(self)  # the tokenizer's markers are shared; only the schemas are the request's
        bound.schemas = {f.name: f.parameters for f in req.functions}
        return bound

    def _calls(self, rest: str) -> list[ParsedCall]:
        calls = []
        for block in rest.split(self.invoke)[1:]:
            name, named, body = block.partition('">')
            if not named:
                calls.append(ParsedCall(None, ""))
                break
            members, done = self._members(name, body)
            calls.append(ParsedCall(name, "{" + ", ".join(members) + ("}" if done else "")))
            if not done:
                break
        return calls

    def _members(self, function: str, body: str) -> tuple[list[str], bool]:
        """The arguments' JSON members written so far (whole parameters only), and whether the call ended."""
        members, i = [], 0
        while True:
            at, ends = body.find(self.parameter, i), body.find(self.invoke_end, i)
            if ends >= 0 and (at < 0 or ends < at):
                return members, True
            if at < 0:
                return members, False
            key, named, after = body[at + len(self.parameter):].partition('">')
            value, closed, _ = after.partition(self.parameter_end)
            if not (named and closed):
                return members, False
            members.append(f"{json.dumps(key)}: {json.dumps(self._value(function, key, value))}")
            i = at + len(self.parameter) + len(key) + 2 + len(value) + len(self.parameter_end)

    def _value(self, function: str, key: str, raw: str) -> Any:
        schema = self.schemas.get(function, {}).get("properties", {}).get(key)
        text = raw[1:] if raw.startswith("\n") else raw
        text = text[:-1] if text.endswith("\n") else text
        if schema is not None and _is_text(schema):
            return text
        try:
            value = json.loads(text)
        except ValueError:
            return text
        return text if isinstance(value, str) and schema is None else value

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        lines = [f"call: {' | '.join(f'call_{i}' for i in range(len(functions)))}", TEXT_RULE.replace("TEXT", "VALUE")]
        for i, f in enumerate(functions):
            props = f.parameters.get("properties") or {}
            required = set(f.parameters.get("required") or ())
            parts = []
            for j, (key, schema) in enumerate(props.items()):
                rule = f"p_{i}_{j}"
                head = json.dumps(f"{self.parameter}{key}\">")
                if _is_text(schema) and "enum" in schema:
                    value = " | ".join(json.dumps(v) for v in schema["enum"])
                    lines.append(f"{rule}: {head} ({value}) {json.dumps(self.parameter_end + chr(10))}")
                elif _is_text(schema):
                    lines.append(f"{rule}: {head} {rule}_text")
                    lines.append(f"{rule}_text[lazy]: VALUE {json.dumps(self.parameter_end + chr(10))}")
                else:
                    lines.append(f"{rule}: {head} {json_schema_rule(schema)} {json.dumps(self.parameter_end + chr(10))}")
                parts.append(rule if key in required else f"{rule}?")
            lines.append(f"call_{i}: {json.dumps(self.invoke + f.name + chr(34) + '>' + chr(10))} {' '.join(parts)} "
                         f"{json.dumps(self.invoke_end + chr(10))}")
        return [f'"\\n" {"call+" if parallel else "call"} {self.lit(self.end)}', *lines]


def _is_text(schema: dict[str, Any]) -> bool:
    """A parameter MiniMax writes as bare text: a string, or one of string values."""
    enum = schema.get("enum")
    if enum is not None:
        return bool(enum) and all(isinstance(v, str) for v in enum)
    return schema.get("type") == "string"

"""Tool-call formats that write each argument as its own tagged value, bare text for a string and JSON for
anything else (MiniMax-M2's ``<parameter>``, GLM's ``<arg_value>``): reading one takes the request's declared
parameter types, so the format binds them per request."""

from __future__ import annotations

import copy
import json
from typing import Any, Callable, ClassVar, Iterable

from strata.pipeline.frontend.tools.format_base import TEXT_RULE, ParsedCall, ToolFormat, json_schema_rule
from strata.pipeline.frontend.tools.request import ToolFunction, ToolRequest


class TypedValueFormat(ToolFormat):
    """A format whose argument values are typed by the request's parameter schemas (``for_request``): each
    argument is ``arg_open KEY key_close ... value_open VALUE value_close``, a call ends at ``call_close``."""

    arg_open: ClassVar[str]
    key_close: ClassVar[str]
    value_open: ClassVar[str]  # "" when the value follows the key's close at once
    value_close: ClassVar[str]
    call_close: ClassVar[str]

    def __init__(self, hf_tokenizer: Any) -> None:
        super().__init__(hf_tokenizer)
        self.schemas: dict[str, dict[str, Any]] = {}  # function name -> its parameters schema (bound per request)

    def for_request(self, req: ToolRequest) -> "TypedValueFormat":
        bound = copy.copy(self)  # the tokenizer's markers are shared; only the schemas are the request's
        bound.schemas = {f.name: f.parameters for f in req.functions}
        return bound

    def _argument(self, function: str, key: str, attributes: str, raw: str) -> Any:
        """One argument's value from its text (``attributes``: what stands between its key and its value)."""
        return self._value(function, key, raw)

    def _value(self, function: str, key: str, raw: str) -> Any:
        """One written value: the text itself for a declared string (one newline either side dropped, as the
        templates write them), else its JSON; unbound, JSON other than a string, else the text."""
        schema = self.schemas.get(function, {}).get("properties", {}).get(key)
        text = raw[1:] if raw.startswith("\n") else raw
        text = text[:-1] if text.endswith("\n") else text
        if schema is not None and is_text(schema):
            return text
        try:
            value = json.loads(text)
        except ValueError:
            return text
        return text if isinstance(value, str) and schema is None else value


    def _read(self, blocks: Iterable[tuple[str | None, str]]) -> list[ParsedCall]:
        """Calls from (name, body) blocks as far as written: a None name is one still being written; a call
        that has not ended is the last."""
        calls = []
        for name, body in blocks:
            if name is None:
                calls.append(ParsedCall(None, ""))
                break
            members, done = self._members(name, body)
            calls.append(ParsedCall(name, "{" + ", ".join(members) + ("}" if done else "")))
            if not done:
                break
        return calls

    def _members(self, function: str, body: str) -> tuple[list[str], bool]:
        """The arguments' JSON members written so far (whole arguments only), and whether the call ended."""
        members, i = [], 0
        while True:
            at, ends = body.find(self.arg_open, i), body.find(self.call_close, i)
            if ends >= 0 and (at < 0 or ends < at):
                return members, True
            if at < 0:
                return members, False
            key, keyed, after = body[at + len(self.arg_open):].partition(self.key_close)
            opened = after.find(self.value_open)
            value, closed, _ = after[opened + len(self.value_open):].partition(self.value_close) if opened >= 0 \
                else ("", "", "")
            if not (keyed and closed):
                return members, False
            members.append(f"{json.dumps(key)}: {json.dumps(self._argument(function, key, after[:opened], value))}")
            i = body.index(self.value_close, at) + len(self.value_close)

    def _call_rules(self, functions: tuple[ToolFunction, ...], call: Callable[[ToolFunction, str], str]) -> list[str]:
        """The grammar's ``call`` (one of the functions) and its rules; ``call(f, arguments)`` is function f's
        call around its arguments' sequence."""
        lines = [f"call: {' | '.join(f'call_{i}' for i in range(len(functions)))}", TEXT_RULE.replace("TEXT", "VALUE")]
        for i, f in enumerate(functions):
            lines.append(f"call_{i}: {call(f, self._argument_rules(i, f, lines))}")
        return lines

    def _argument_rules(self, i: int, f: ToolFunction, lines: list[str]) -> str:
        """Function ``i``'s arguments in the grammar: adds a rule per parameter to ``lines``, returns their
        sequence (optional ones marked). ``VALUE`` is free text, defined by the caller."""
        props = f.parameters.get("properties") or {}
        required = set(f.parameters.get("required") or ())
        parts, close = [], self._grammar_close()
        for j, (key, schema) in enumerate(props.items()):
            rule, head = f"p_{i}_{j}", self._grammar_head(key, schema)
            if is_text(schema) and "enum" in schema:
                lines.append(f"{rule}: {head} (" + " | ".join(json.dumps(v) for v in schema["enum"]) + f") {close}")
            elif is_text(schema) and self.value_close in self.token_ids:  # text until the closing token
                lines.append(f"{rule}: {head} VALUE {close}")
            elif is_text(schema):  # text until the closing text, lazily (it cannot run on through it)
                lines.append(f"{rule}: {head} {rule}_text")
                lines.append(f"{rule}_text[lazy]: VALUE {close}")
            else:
                lines.append(f"{rule}: {head} {json_schema_rule(schema)} {close}")
            parts.append(rule if key in required else f"{rule}?")
        return " ".join(parts)

    def _grammar_head(self, key: str, schema: dict[str, Any]) -> str:
        """What a grammar writes before argument ``key``'s value (``schema``: its parameter's)."""
        raise NotImplementedError

    def _grammar_close(self) -> str:
        """What a grammar writes after a value."""
        raise NotImplementedError


def is_text(schema: dict[str, Any]) -> bool:
    """A parameter written as bare text: a string, or one of string values."""
    enum = schema.get("enum")
    if enum is not None:
        return bool(enum) and all(isinstance(v, str) for v in enum)
    return schema.get("type") == "string"

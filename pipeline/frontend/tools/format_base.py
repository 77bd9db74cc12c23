"""What every tool-call format shares: the parsed shapes, the ``ToolFormat`` base (markers as the checkpoint's
tokens, reading, the grammar of the answers a request allows) and the JSON-call helpers the families use. The
families are ``json_formats``, ``marker_formats``, ``minimax_format`` and ``harmony_format``; ``formats`` lists them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from strata.pipeline.frontend.stream_text import held_back
from strata.pipeline.frontend.structured import JSON_LAYOUT
from strata.pipeline.frontend.tools.json_scan import object_members, skip_ws, value_end
from strata.pipeline.frontend.tools.request import ToolFunction, ToolRequest

TEXT_RULE = "TEXT: /(.|\\n)*/"


@dataclass
class ParsedCall:
    name: str | None  # None until the name is fully written
    arguments: str  # the arguments' JSON text as far as written
    call_id: str | None = None  # the model's own id (Kimi-K2); otherwise the server makes one


@dataclass
class ParsedOutput:
    content: str  # text outside the calls that can no longer change
    calls: list[ParsedCall] = field(default_factory=list)


class ToolFormat:
    """One family's tool-call syntax, bound to a checkpoint's tokenizer (for its special tokens)."""

    name: ClassVar[str]
    start: ClassVar[str]  # the marker that opens the calls
    markers: ClassVar[tuple[str, ...]]  # every marker the calls use (special tokens in some checkpoints)
    signature: ClassVar[str]  # text in a chat template that says it writes calls this way
    enforces_auto: ClassVar[bool] = True  # ``auto`` holds a begun call to the schemas by a grammar
    reads_whole_output: ClassVar[bool] = False  # reads the calls out of the whole output, reasoning included

    def __init__(self, hf_tokenizer: Any) -> None:
        added = {str(tok): (int(i), bool(getattr(tok, "special", False)))
                 for i, tok in getattr(hf_tokenizer, "added_tokens_decoder", {}).items()}
        # markers that are one added token: a grammar names them by id (llguidance keeps added tokens out of
        # text), and those marked special are kept when the answer is detokenized
        self.token_ids = {m: added[m][0] for m in self.markers if m in added}
        self.special = {m for m in self.token_ids if added[m][1]}

    @property
    def keeps_special_tokens(self) -> bool:
        """Some markers are special tokens: detokenize with them kept, or parse would not see them."""
        return bool(self.special)

    def lit(self, marker: str) -> str:
        """A marker in Lark: its token by id, or the text."""
        token = self.token_ids.get(marker)
        return f"<[{token}]>" if token is not None else json.dumps(marker)

    def for_request(self, req: ToolRequest) -> "ToolFormat":
        """The format as it reads one request's answer (a family whose values depend on the declared
        parameters' types binds them; the others read every answer alike)."""
        return self

    # ------------------------------------------------------------ reading
    def parse(self, text: str, final: bool) -> ParsedOutput:
        at = text.find(self.start)
        if at < 0:
            return ParsedOutput(text if final else stable_text(text, self.start))
        return ParsedOutput(text[:at].rstrip(), self._calls(text[at + len(self.start):]))

    def _calls(self, rest: str) -> list[ParsedCall]:
        raise NotImplementedError

    # ------------------------------------------------------------ enforcing
    def grammar(self, req: ToolRequest, calls_only: bool = False) -> str:
        """The answers ``req`` allows; ``calls_only`` as for ``required`` (a grammar that starts at its opening
        marker, for ``auto`` with a one-token marker as the trigger)."""
        after = self._after_start(req.callable_functions(), req.parallel)
        lines = ["%llguidance {}", *after[1:]]
        if calls_only or req.choice in ("required", "function"):
            lines.insert(1, f"start: {self.lit(self.start)} {after[0]}")
        elif self.start in self.token_ids:  # an added token never appears in free text
            lines[1:1] = [f"start: TEXT | TEXT {self.lit(self.start)} {after[0]}", TEXT_RULE]
        else:  # free text until the marker, lazily: the text cannot run on through it
            lines[1:1] = [f"start: TEXT | opening {after[0]}", f"opening[lazy]: TEXT {self.lit(self.start)}", TEXT_RULE]
        return "\n".join(lines)

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        """What follows the opening marker: [the rule body, extra rule lines...]."""
        raise NotImplementedError


def stable_text(text: str, marker: str) -> str:
    """Text before any possible start of ``marker`` at its end, and before trailing whitespace (dropped
    if a call follows): what a stream may send as content."""
    return held_back(text, marker).rstrip()


def json_schema_rule(schema: dict[str, Any]) -> str:
    """A schema in a grammar, laid out as ``json.dumps`` lays JSON out (``structured.JSON_LAYOUT``)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def call_object(functions: tuple[ToolFunction, ...], arguments_key: str) -> dict[str, Any]:
    """{"name": <one of them>, <arguments_key>: <its parameters>}, name first (so it streams first)."""
    options = [{"type": "object", "properties": {"name": {"const": f.name}, arguments_key: f.parameters},
                "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def json_call(text: str, start: int, keys: tuple[str, ...]) -> ParsedCall | None:
    """The call of a JSON object ``{"name": ..., <key>: {...}}`` at ``text[start]``, as far as written."""
    if start >= len(text) or text[start] != "{":
        return None
    name, arguments, complete = None, "", False
    for key, begin, end in object_members(text, start):
        if key == "name" and end is not None:
            try:
                value = json.loads(text[begin:end])
            except ValueError:
                value = None
            name = value if isinstance(value, str) else None
        elif key in keys:
            raw = text[begin:end] if end is not None else text[begin:]
            if raw.startswith('"'):  # arguments written as a JSON string: whole, once it ends
                arguments = _string_value(raw) if end is not None else ""
            else:
                arguments = raw
            complete = end is not None
    if not complete and value_end(text, start) is not None:  # a finished call without arguments
        arguments = arguments or "{}"
    return ParsedCall(name, arguments)


def call_sequence(text: str, i: int, separator: str, keys: tuple[str, ...]) -> list[ParsedCall]:
    """The calls of JSON objects from ``text[i]`` on, joined by ``separator``, as far as written."""
    calls = []
    while (call := json_call(text, i, keys)) is not None:
        calls.append(call)
        end = value_end(text, i)
        if end is None:
            break
        i = skip_ws(text, end)
        if text[i:i + 1] != separator:
            break
        i = skip_ws(text, i + 1)
    return calls


def _string_value(raw: str) -> str:
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return value if isinstance(value, str) else raw

"""How each model family writes tool calls: reading them from its output, and the grammar that makes
it write them well-formed.

One class per family, named as vLLM's ``--tool-call-parser`` names them:

- ``hermes`` (Qwen2.5 / Qwen3, Hermes, and most chatml models):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call;
- ``llama3_json`` (Llama 3.1+): ``{"name": ..., "parameters": {...}}`` as the whole answer, calls joined
  by ``; `` (an optional ``<|python_tag|>`` first);
- ``mistral`` (Mistral / Mixtral v3 tokenizers): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
- ``kimi_k2`` (Kimi-K2 / K2.5): ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``;
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and the arguments
  in a fenced json block, ``<｜tool▁call▁end｜>``, ..., ``<｜tool▁calls▁end｜>``;
- ``minimax_m2``: ``<minimax:tool_call>`` then per call ``<invoke name="NAME">`` with one
  ``<parameter name="KEY">VALUE</parameter>`` per argument (bare text for strings, JSON otherwise);
- ``openai`` (gpt-oss): a harmony message addressed ``to=functions.NAME`` whose body is the arguments.

``parse`` reads a possibly unfinished output, so the same code serves whole answers and streams: the
content that can no longer change, and each call's name and its arguments as far as written (the
arguments are the model's own JSON text, so what a stream sends adds up to what a whole answer holds).

``grammar`` is the Lark grammar (llguidance) of an answer the request allows: for ``required`` or a named
function, only calls; for ``auto``, free text or calls. With ``auto`` and an opening marker that is one token
(Qwen's ``<tool_call>``, Mistral's, Kimi-K2's), ``calls.constrain`` makes that token the grammar's trigger:
the text before it is unconstrained and costs no mask. Otherwise the calls are triggered lazily by the marker's
text inside the grammar. Either way a call, once begun, names a declared function and its arguments satisfy that function's
parameters schema. A marker that is one added token of the checkpoint's tokenizer is written in the grammar
by its id; one that is a special token makes the answer detokenize with special tokens kept, or the
marker would vanish from the text.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from strata.pipeline.frontend.harmony import CONSTRAIN, ENDS, FUNCTIONS, MESSAGE, harmony_messages
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
            return ParsedOutput(text if final else _stable_text(text, self.start))
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


def _stable_text(text: str, marker: str) -> str:
    """Text before any possible start of ``marker`` at its end, and before trailing whitespace (dropped
    if a call follows): what a stream may send as content."""
    for j in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:j]):
            text = text[:-j]
            break
    return text.rstrip()


def _json_schema(schema: dict[str, Any]) -> str:
    """A schema in a grammar, laid out as ``json.dumps`` lays JSON out (``structured.JSON_LAYOUT``)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def _call_object(functions: tuple[ToolFunction, ...], arguments_key: str) -> dict[str, Any]:
    """{"name": <one of them>, <arguments_key>: <its parameters>}, name first (so it streams first)."""
    options = [{"type": "object", "properties": {"name": {"const": f.name}, arguments_key: f.parameters},
                "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _json_call(text: str, start: int, keys: tuple[str, ...]) -> ParsedCall | None:
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


def _call_sequence(text: str, i: int, separator: str, keys: tuple[str, ...]) -> list[ParsedCall]:
    """The calls of JSON objects from ``text[i]`` on, joined by ``separator``, as far as written."""
    calls = []
    while (call := _json_call(text, i, keys)) is not None:
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


class Hermes(ToolFormat):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    markers = (start, end)
    signature = "<tool_call>"

    def _calls(self, rest: str) -> list[ParsedCall]:
        calls = []
        for block in rest.split(self.start):
            call = _json_call(block, skip_ws(block, 0), ("arguments", "parameters"))
            if call is not None:
                calls.append(call)
        return calls

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        one = f'"\\n" call_json "\\n" {self.lit(self.end)}'
        more = f' ("\\n" {self.lit(self.start)} {one})*' if parallel else ""
        return [f"{one}{more}", "call_json: " + _json_schema(_call_object(functions, "arguments"))]


class Mistral(ToolFormat):
    name = "mistral"
    start = "[TOOL_CALLS]"
    markers = (start,)
    signature = "[TOOL_CALLS]"

    def _calls(self, rest: str) -> list[ParsedCall]:
        i = skip_ws(rest, 0)
        if i >= len(rest) or rest[i] != "[":
            return []
        return _call_sequence(rest, skip_ws(rest, i + 1), ",", ("arguments", "parameters"))

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        schema = {"type": "array", "items": _call_object(functions, "arguments"), "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return ["calls_json", "calls_json: " + _json_schema(schema)]


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
            return ParsedOutput(text if final else _stable_text(text, ""))
        return ParsedOutput("", _call_sequence(body, 0, ";", ("parameters", "arguments")))

    def grammar(self, req: ToolRequest, calls_only: bool = False) -> str:
        one = "call_json"
        calls = f'{one} ("; " {one})*' if req.parallel else one
        start = calls if calls_only or req.choice in ("required", "function") else f"FREE | {calls}"
        return "\n".join(["%llguidance {}", f"start: {start}", "FREE: /([^{](.|\\n)*)?/",
                          "call_json: " + _json_schema(_call_object(req.callable_functions(), "parameters"))])


class KimiK2(ToolFormat):
    name = "kimi_k2"
    start = "<|tool_calls_section_begin|>"
    end = "<|tool_calls_section_end|>"
    call_begin, argument_begin, call_end = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    markers = (start, end, call_begin, argument_begin, call_end)
    signature = "<|tool_calls_section_begin|>"

    def _calls(self, rest: str) -> list[ParsedCall]:
        calls = []
        for block in rest.split(self.call_begin)[1:]:
            head, sep, arguments = block.partition(self.argument_begin)
            if not sep:
                break
            call_id = head.strip()  # functions.NAME:IDX
            name = call_id.split(".", 1)[-1].rsplit(":", 1)[0]
            body, done, _ = arguments.partition(self.call_end)
            calls.append(ParsedCall(name, body.strip() if done else _stable_text(body, self.call_end).lstrip(),
                                    call_id))
        return calls

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        lines = [f"call: {' | '.join(f'call_{i}' for i in range(len(functions)))}", "INDEX: /[0-9]{1,4}/"]
        for i, f in enumerate(functions):
            lines.append(f"call_{i}: {self.lit(self.call_begin)} {json.dumps('functions.' + f.name + ':')} INDEX "
                         f"{self.lit(self.argument_begin)} {_json_schema(f.parameters)} {self.lit(self.call_end)}")
        return [f"{'call+' if parallel else 'call'} {self.lit(self.end)}", *lines]


class DeepSeekV3(ToolFormat):
    """DeepSeek-V3's calls: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the
    arguments in a fenced json block, ``<｜tool▁call▁end｜>``, ...,  ``<｜tool▁calls▁end｜>``."""

    name = "deepseek_v3"
    start, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, sep, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    markers = (start, end, call_begin, sep, call_end)
    signature = "<｜tool▁calls▁begin｜>"
    fence_open, fence_close = "```json\n", "\n```"

    def _calls(self, rest: str) -> list[ParsedCall]:
        calls = []
        for block in rest.split(self.call_begin)[1:]:
            _, found, after = block.partition(self.sep)
            name, newline, body = after.partition("\n")
            if not found or not newline:
                break
            arguments = body.split(self.call_end)[0].partition(self.fence_open.strip("\n"))[2]
            arguments, closed, _ = arguments.partition(self.fence_close)
            calls.append(ParsedCall(name.strip(), arguments.strip() if closed else
                                    _stable_text(arguments, self.fence_close).lstrip()))
        return calls

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        lines = [f"call: {' | '.join(f'call_{i}' for i in range(len(functions)))}"]
        for i, f in enumerate(functions):
            lines.append(f"call_{i}: {self.lit(self.call_begin)} \"function\" {self.lit(self.sep)} "
                         f"{json.dumps(f.name + chr(10) + self.fence_open)} {_json_schema(f.parameters)} "
                         f"{json.dumps(self.fence_close)} {self.lit(self.call_end)}")
        return [f"{'call+' if parallel else 'call'} {self.lit(self.end)}", *lines]


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
                    lines.append(f"{rule}: {head} {_json_schema(schema)} {json.dumps(self.parameter_end + chr(10))}")
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


class HarmonyCalls(ToolFormat):
    """gpt-oss's calls: harmony messages addressed to a function (``frontend.harmony``), ``<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|>``; the content is the final channel's text
    (and a preamble addressed to no one), never the analysis. The calls' markers open every harmony message,
    so no trigger can tell a call from the analysis: ``auto`` reads calls as the model writes them, unenforced
    (``enforces_auto``), while ``required`` and a named function start the answer at a call."""

    name = "openai"
    start = "<|channel|>"
    markers = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
    signature = FUNCTIONS
    enforces_auto = False
    reads_whole_output = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        if MESSAGE not in text:  # no harmony message (yet)
            return ParsedOutput(text if final else "")
        content, calls = [], []
        for message in harmony_messages(text, final):
            recipient = message.recipient
            if recipient is not None and recipient.startswith("functions."):
                calls.append(ParsedCall(recipient[len("functions."):], message.body))
            elif recipient is None and message.channel != "analysis":
                content.append(message.body)
        return ParsedOutput("".join(content), calls)

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        lines = [f"call: {' | '.join(f'call_{i}' for i in range(len(functions)))}"]
        for i, f in enumerate(functions):  # one call: <|call|> ends the model's turn
            lines.append(f"call_{i}: {json.dumps('commentary ' + FUNCTIONS + f.name + ' ')} {self.lit(CONSTRAIN)} "
                         f'"json" {self.lit(MESSAGE)} {_json_schema(f.parameters)} {self.lit(ENDS[2])}')
        return ["call", *lines]


TOOL_FORMATS: dict[str, type[ToolFormat]] = {f.name: f for f in (Hermes, Llama3Json, Mistral, KimiK2, DeepSeekV3,
                                                                   MiniMaxM2, HarmonyCalls)}


def detect_tool_format(chat_template: str | None) -> str | None:
    """The family a chat template writes tool calls in (None: it renders no tools, or none we know)."""
    if not chat_template or "tools" not in chat_template:
        return None
    for fmt in (HarmonyCalls, KimiK2, DeepSeekV3, MiniMaxM2, Mistral, Hermes, Llama3Json):  # most specific first
        if fmt.signature in chat_template:
            return fmt.name
    return None


def tool_format_for(parser: str, hf_tokenizer: Any) -> ToolFormat | None:
    """The tool-call format a server reads: ``parser`` names one, ``auto`` reads it off the chat template,
    ``none`` turns tool calling off."""
    if parser == "none":
        return None
    name = detect_tool_format(getattr(hf_tokenizer, "chat_template", None)) if parser == "auto" else parser
    if name is None:
        return None
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; expected auto, none or one of {', '.join(TOOL_FORMATS)}")
    return TOOL_FORMATS[name](hf_tokenizer)

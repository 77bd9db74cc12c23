"""Structured output requests, as grammars: a JSON schema, any JSON object, a regex, a choice, or a Lark
grammar, turned into the grammar llguidance runs and checked before the request is admitted.

llguidance (Microsoft's Rust grammar engine) was measured against xgrammar on this CPU with SmolLM2's
49,152-token vocabulary: the next-token mask costs 60 us with llguidance against 431 us with xgrammar,
a grammar compiles in ~3 ms against ~6 ms, and llguidance computes masks lazily (an Earley parser over
the token trie), so nothing heavy is built per schema. Grammars are cached by their source, and a
request's grammar is validated here, on the front door's thread: an invalid schema, regex or grammar is
a ``ValueError`` naming the problem (an HTTP 400), and never reaches the step loop.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from threading import Lock
from typing import Any

KINDS = ("json", "regex", "choice", "lark")
# JSON laid out as json.dumps does, one space after ":" and ",", no other whitespace: a model cannot spend
# its tokens on blank space, and the output is what clients expect (a schema's "x-guidance" may override it)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SPEC_CHARS = 256 * 1024  # a schema or grammar larger than this is refused, not compiled

_cache: OrderedDict[tuple[str, str], str] = OrderedDict()
_lock = Lock()


def grammar_for(kind: str, value: str) -> str:
    """The llguidance grammar of a structured-output spec (cached by source); ValueError naming what is wrong."""
    key = (kind, value)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    grammar = _build(kind, value)
    with _lock:
        _cache[key] = grammar
        while len(_cache) > 256:
            _cache.popitem(last=False)
    return grammar


def _build(kind: str, value: str) -> str:
    from llguidance import LLMatcher

    if kind not in KINDS:
        raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if len(value) > MAX_SPEC_CHARS:
        raise ValueError(f"the {kind} specification has {len(value)} characters; at most {MAX_SPEC_CHARS}")
    if kind == "json":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("the JSON schema must be an object")
        grammar = LLMatcher.grammar_from_json_schema(value, defaults=JSON_LAYOUT)
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        choices = json.loads(value)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("a choice must be a non-empty list of non-empty strings")
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    else:
        grammar = LLMatcher.grammar_from_lark(value)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"invalid {_NAMES[kind]}: {error.strip().splitlines()[0]}")
    return grammar


_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "lark": "grammar"}


def spec_from_openai(body: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, source) from a request's ``response_format`` (OpenAI) or vLLM's ``guided_json`` /
    ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` / ``structured_outputs``; None for plain
    text. At most one may be given; ValueError names a malformed one."""
    found: list[tuple[str, str]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError("response_format.type must be text, json_object or json_schema")
        if fmt["type"] == "json_object":
            found.append(("json", json.dumps({"type": "object"})))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("response_format.json_schema must be an object with a schema object")
            found.append(("json", json.dumps(spec.get("schema", {}))))
    guided = {"json": body.get("guided_json"), "regex": body.get("guided_regex"),
              "choice": body.get("guided_choice"), "lark": body.get("guided_grammar")}
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise ValueError("structured_outputs must be an object (json, regex, choice or grammar)")
        for key, kind in (("json", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "lark")):
            if outputs.get(key) is not None:
                guided[kind] = outputs[key]
    for kind, value in guided.items():
        if value is None:
            continue
        if kind == "json":
            found.append(("json", value if isinstance(value, str) else json.dumps(value)))
        elif kind == "choice":
            found.append(("choice", json.dumps(value)))
        elif not isinstance(value, str):
            raise ValueError(f"guided_{'grammar' if kind == 'lark' else kind} must be a string")
        else:
            found.append((kind, value))
    if len(found) > 1:
        raise ValueError("give one structured output constraint (response_format, guided_* or structured_outputs)")
    return found[0] if found else None

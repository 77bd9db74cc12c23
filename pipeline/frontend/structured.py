"""Structured output requests, as grammars: a JSON schema, any JSON object, a regex, a choice, or a Lark
grammar, turned into the grammar llguidance runs and checked before the request is admitted.

llguidance (Microsoft's Rust grammar engine) was measured against xgrammar on this CPU with SmolLM2's
49,152-token vocabulary: the next-token mask costs 60 us with llguidance against 431 us with xgrammar,
a grammar compiles in ~3 ms against ~6 ms, and llguidance computes masks lazily (an Earley parser over
the token trie), so nothing heavy is built per schema. Grammars are cached by their source. A spec is
measured against the server's limits first (``grammar_limits``: repetitions, depth, rules, choices), then
built and validated: an invalid or oversized schema, regex or grammar is a ``ValueError`` naming the
problem (an HTTP 400). Compiling it against the vocabulary, which can be slow or crash, happens in a
sandbox process at the front door (``grammar_sandbox``) and on a worker thread in the engine
(``core.grammar``), never on a step loop.

A choice is one regex lexeme (an alternation of the escaped strings), not a grammar rule per choice: an
Earley row holds at most 2,000 items, while a lexeme of 20,000 choices costs 0.2 ms per mask.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from threading import Lock
from typing import Any

from strata.pipeline.frontend.grammar_limits import check_choices, check_json_depth, check_regex
from strata.pipeline.frontend.lark_limits import check_lark
from strata.pipeline.frontend.schema_limits import check_schema

KINDS = ("json", "regex", "choice", "lark")
# JSON laid out as json.dumps does, one space after ":" and ",", no other whitespace: a model cannot spend
# its tokens on blank space, and the output is what clients expect (a schema's "x-guidance" may override it)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SPEC_CHARS = 256 * 1024  # a schema or grammar larger than this is refused, not compiled

_cache: OrderedDict[tuple[str, str], str] = OrderedDict()
_lock = Lock()


def grammar_for(kind: str, value: str) -> str:
    """The llguidance grammar of a structured-output spec (cached by source); ValueError naming what is wrong.
    It runs llguidance's validator, which can crash on what the limits did not foresee: call it only in a
    process that may crash (the sandbox) or on a spec the sandbox has compiled."""
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


def check_limits(kind: str, value: str) -> None:
    """The checks that need no grammar engine: the kind, the size, valid JSON where JSON is due, and the
    limits of ``grammar_limits``. Pure Python and iterative: safe on any input, in any process (the front
    door runs these before it lets the sandbox compile anything)."""
    if kind not in KINDS:
        raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if len(value) > MAX_SPEC_CHARS:
        raise ValueError(f"the {kind} specification has {len(value)} characters; at most {MAX_SPEC_CHARS}")
    if kind == "json":
        check_schema(_schema(value))
    elif kind == "regex":
        check_regex(value)
    elif kind == "choice":
        check_choices(_choices(value))
    else:
        check_lark(value)


def _schema(value: str) -> Any:
    check_json_depth(value, "JSON schema")
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("the JSON schema must be an object")
    return schema


def _choices(value: str) -> list[str]:
    check_json_depth(value, "choice")
    try:
        choices = json.loads(value)
    except json.JSONDecodeError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("a choice must be a non-empty list of non-empty strings")
    return choices


def _build(kind: str, value: str) -> str:
    from llguidance import LLMatcher

    check_limits(kind, value)
    if kind == "json":
        grammar = LLMatcher.grammar_from_json_schema(value, defaults=JSON_LAYOUT)
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        grammar = LLMatcher.grammar_from_regex("(?:" + "|".join(_literal(c) for c in dict.fromkeys(_choices(value))) + ")")
    else:
        grammar = LLMatcher.grammar_from_lark(value)
    error = LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise ValueError(f"invalid {_NAMES[kind]}: {error.strip().splitlines()[0]}")
    return grammar


def tokenizer_spec(hf_tokenizer: Any) -> tuple[str, int | None]:
    """What llguidance builds its tokenizer from: the fast tokenizer serialized (added tokens included,
    padding and truncation off) and its EOS id, as ``llguidance.hf.from_tokenizer`` reads them. A plain
    pair, so the grammar sandbox builds the same tokenizer without importing transformers (or torch)."""
    from copy import copy

    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured output needs a fast (Rust) tokenizer, and this model has none")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str(), hf_tokenizer.eos_token_id


def llg_tokenizer(spec: tuple[str, int | None], vocab_size: int) -> Any:
    """llguidance's tokenizer (the vocabulary as a trie: ~0.5 s for 49K tokens) from :func:`tokenizer_spec`."""
    from llguidance import LLTokenizer

    text, eos = spec
    return LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)


def parser_limits() -> Any:
    """The limits every matcher of this server runs under (the sandbox's probe and the engine alike), with
    short errors: a verbose one dumps the parser's state, which a client has no use for."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=False)


_META = set("\\.+*?()|[]{}^$#&-~")


def _literal(text: str) -> str:
    """``text`` as a regex that matches exactly it (Rust's ``regex::escape``: its meta characters only)."""
    return "".join("\\" + ch if ch in _META else ch for ch in text)


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

"""The limits a structured-output spec is measured against before anything compiles it (``grammar_limits``,
``schema_limits``, ``lark_limits``): each grammar that used to reach a limit mid-answer, or overflow the
compiler's stack, is refused by name; grammars people write (recursive schemas, a calculator, every tool
family's grammar for many tools) pass; the measures themselves count what they say."""

from __future__ import annotations

import json

import pytest

from strata.pipeline.frontend.grammar_limits import MAX_REPEAT, GrammarLimitError, json_depth, regex_repeats
from strata.pipeline.frontend.structured import check_limits, spec_from_openai


def _ref_chain(n: int) -> str:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


def _rule_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "x"\n'


REFUSED = [
    (("lark", 'start: "a"~1000000'), "repeats 1000000 copies"),
    (("regex", "a{1000000}"), "repeats 1000000 copies"),
    (("regex", "(a{200}){200}"), "repeats 40000 copies"),  # nested counts multiply
    (("lark", 'start: ("a" "b"){100}{200}'), "repeats 20000 copies"),
    (("choice", json.dumps([f"c{i}" for i in range(10_001)])), "10001 choices; at most 10000"),
    (("json", json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})),
     "admits no value"),
    (("json", json.dumps({"$ref": "#"})), "admits no value"),
    (("json", json.dumps({"allOf": [{"$ref": "#"}]})), "admits no value"),
    (("json", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
                          "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}})), "admits no value"),
    (("json", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},  # optional, still a trap
                          "$defs": {"x": {"$ref": "#/$defs/x"}}})), "#/$defs/x admits no value"),
    (("json", _ref_chain(5000)), "nests more than 128 levels deep"),
    (("json", "[" * 5000 + "]" * 5000), "nests 5000 levels deep; at most 64"),
    (("json", json.dumps({"type": "string", "pattern": "^a{100000}$"})), "pattern at # repeats 100000 copies"),
    (("lark", _rule_chain(10_000)), "more than 1000 rules"),
    (("lark", _rule_chain(500)), "chain more than 128 deep"),
    (("lark", "start: " + " | ".join(f'"c{i}"' for i in range(2500))), "more than 1000 alternatives"),
    (("lark", 'start: "x" %json {"$ref": "#"}'), "admits no value"),
    (("lark", 'start: /[a-z]{20000}/'), "repeats 20000 copies"),
]


@pytest.mark.parametrize("spec, message", REFUSED, ids=[f"{s[0]}-{i}" for i, (s, _) in enumerate(REFUSED)])
def test_a_spec_past_a_limit_is_refused_by_name(spec: tuple[str, str], message: str) -> None:
    with pytest.raises(GrammarLimitError, match=message.replace("$", r"\$")):
        check_limits(*spec)


TREE = {"$defs": {"node": {"type": "object", "properties": {"name": {"type": "string"},
                                                            "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                           "required": ["name"]}}, "$ref": "#/$defs/node"}
ACCEPTED = [
    ("json", json.dumps(TREE)),  # recursion with a way out: an empty list of kids
    ("json", json.dumps({"anyOf": [{"$ref": "#"}, {"type": "null"}]})),
    ("json", json.dumps({"$defs": {"n": {"type": ["object", "null"], "properties": {"next": {"$ref": "#/$defs/n"}},
                                         "required": ["next"]}}, "$ref": "#/$defs/n"})),  # a nullable linked list
    ("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False})),
    ("json", _ref_chain(100)),
    ("json", json.dumps({"type": "string", "pattern": r"^\d{3}-\d{4}$", "maxLength": 10_000_000})),
    ("regex", r"(\d{1,3}\.){3}\d{1,3}"),
    ("regex", "[a-z]{1,10000}"),
    ("choice", json.dumps([f"choice {i}" for i in range(10_000)])),
    ("lark", 'start: expr\nexpr: term | expr "+" term\nterm: NUM | "(" expr ")"\nNUM: /[0-9]{1,9}/  # a sum\n'),
    ("lark", _rule_chain(100)),
    ("lark", 'start: "a"~10000'),
]


@pytest.mark.parametrize("spec", ACCEPTED, ids=[f"{s[0]}-{i}" for i, s in enumerate(ACCEPTED)])
def test_specs_people_write_pass(spec: tuple[str, str]) -> None:
    check_limits(*spec)


def test_every_tool_familys_grammar_for_many_tools_passes() -> None:
    """The grammars tool calling writes (``frontend.tools.formats``) for 64 tools pass the limits they are
    held to, ``auto`` and ``required`` alike."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    from strata.pipeline.frontend.tools.formats import TOOL_FORMATS
    from strata.pipeline.frontend.tools.request import tool_request

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")))
    params = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": params}} for i in range(64)]
    for fmt in TOOL_FORMATS.values():
        for choice in ("auto", "required"):
            check_limits("lark", fmt(tok).grammar(tool_request(tools, choice, None)))


@pytest.mark.parametrize("pattern, copies", [("a{7}", 7), ("(a{5}){3}", 15), ("(ab){3}", 3), ("a{5}b{3}", 8),
                                             (r"\d{1,3}(\.\d{1,3}){3}", 12), ("[a-z{}]{4}", 4), (r"\p{L}{2}", 2),
                                             ("[[:alpha:]]{7}", 7), ("a{3,}", 3), ("a{2,5}?", 5), ("x*y+z?", 0)])
def test_regex_copies_are_counted_as_expanded(pattern: str, copies: int) -> None:
    assert regex_repeats(pattern) == copies


def test_json_nesting_is_read_without_parsing_and_strings_do_not_count() -> None:
    assert json_depth('[[{"a": "[[[{{{"}]]') == 3
    assert json_depth('"[[["') == 0
    assert MAX_REPEAT == 10_000  # the figure the README and the refusals name


def test_a_guided_json_string_nested_too_deep_is_a_value_error_not_a_recursion_error() -> None:
    spec = spec_from_openai({"guided_json": "[" * 5000 + "]" * 5000})
    with pytest.raises(ValueError, match="nests 5000 levels deep"):
        check_limits(*spec)

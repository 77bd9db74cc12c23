"""A Lark grammar's size, measured before llguidance compiles it (``grammar_limits`` says why).

A small tokenizer of llguidance's Lark dialect (strings, ``/regex/`` s, ``#`` and ``//`` comments,
``<special>`` tokens, ``%json {...}`` and the other ``%`` directives, ``~ n..m`` and ``{m,n}`` counts)
reads the rules, each rule's alternatives and the rules it names, and the copies its counts make. The
rule graph's longest chain (recursion cut where a rule is already on the path) is the compiler's
recursion depth. Inline ``%json`` schemas (tool calls' arguments) pass the schema limits, and regexes
the regex limits.
"""

from __future__ import annotations

import json
import re

from strata.pipeline.frontend.grammar_limits import (
    MAX_ALTERNATIVES,
    MAX_DEPTH,
    MAX_REPEAT,
    MAX_RULES,
    GrammarLimitError,
    check_json_depth,
    regex_repeats,
)
from strata.pipeline.frontend.schema_limits import check_schema

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_TILDE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
_BRACES = re.compile(r"\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}")
_HEAD = re.compile(r"[?!]?([A-Za-z_][A-Za-z0-9_\-]*)(?:\.-?\d+)?\s*(?:\[[^\]\n]*\])?\s*:")


class _Rule:
    __slots__ = ("name", "alternatives", "names")

    def __init__(self, name: str) -> None:
        self.name = name
        self.alternatives = 1
        self.names: list[str] = []


def check_lark(text: str) -> None:
    """GrammarLimitError if the grammar has too many rules or alternatives, chains too deep, repeats
    too much, or inlines a schema or regex past its limits."""
    rules: dict[str, _Rule] = {}
    rule: _Rule | None = None
    frames = [0]  # copies counted in each open group of the current rule, innermost last
    pending: int | None = None  # copies inside the group that just closed (its count multiplies them)
    copies = 0
    i, n, line_start = 0, len(text), True
    while i < n:
        ch = text[i]
        if ch == "\n":
            i, line_start = i + 1, True
            continue
        if ch in " \t\r":
            i += 1
            continue
        if ch == "#" or text.startswith("//", i):
            i = _line_end(text, i)
            continue
        if line_start and (head := _HEAD.match(text, i)):
            copies += sum(frames) + (pending or 0)
            frames, pending = [0], None
            rule = rules.setdefault(head.group(1), _Rule(head.group(1)))
            if len(rules) > MAX_RULES:
                raise GrammarLimitError(f"the grammar has more than {MAX_RULES} rules")
            i, line_start = head.end(), False
            continue
        line_start = False
        count = _count_at(text, i)
        if count is not None:
            times, i = count
            pending = times * max(1, pending) if pending is not None else times  # a count may follow
            continue
        if pending is not None:
            frames[-1] += pending
            pending = None
        if ch == '"':
            i = _string_end(text, i)
        elif ch == "/":
            end = _regex_end(text, i)
            frames[-1] += regex_repeats(text[i + 1 : end - 1])
            i = end
            while i < n and text[i].isalpha():  # flags
                i += 1
        elif ch == "<":
            close = text.find(">", i)
            i = n if close < 0 else close + 1
        elif ch == "%":
            i = _directive(text, i)
        elif ch in "([":
            frames.append(0)
            i += 1
        elif ch in ")]" and len(frames) > 1:
            pending = frames.pop()
            i += 1
        elif ch == "|" and len(frames) == 1 and rule is not None:
            rule.alternatives += 1
            if rule.alternatives > MAX_ALTERNATIVES:
                raise GrammarLimitError(f"rule {rule.name} has more than {MAX_ALTERNATIVES} alternatives")
            i += 1
        elif name := _NAME.match(text, i):
            if rule is not None:
                rule.names.append(name.group())
            i = name.end()
        else:
            i += 1
    copies += sum(frames) + (pending or 0)
    if copies > MAX_REPEAT:
        raise GrammarLimitError(f"the grammar repeats {copies} copies in all (counts such as ~ n or {{n}}, multiplied "
                                f"where nested); at most {MAX_REPEAT}")
    _check_depth(rules)


def _count_at(text: str, i: int) -> tuple[int, int] | None:
    """A repetition count at ``text[i]`` (``~ n``, ``~ n..m``, ``{n}``, ``{m,n}``): (copies, end)."""
    m = _TILDE.match(text, i) if text[i] == "~" else _BRACES.match(text, i) if text[i] == "{" else None
    if m is None:
        return None
    numbers = [int(g) for g in (m.group(1), m.group(3) if m.re is _BRACES else m.group(2)) if g]
    return max(numbers, default=0), m.end()


def _line_end(text: str, i: int) -> int:
    end = text.find("\n", i)
    return len(text) if end < 0 else end


def _string_end(text: str, i: int) -> int:
    i += 1
    while i < len(text) and text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    return min(len(text), i + 1)


def _regex_end(text: str, i: int) -> int:
    i += 1
    while i < len(text) and text[i] not in "/\n":
        i += 2 if text[i] == "\\" else 1
    return min(len(text), i + 1)


def _directive(text: str, i: int) -> int:
    """Past a ``%`` directive: ``%json {schema}`` is checked as a schema; other blocks are skipped, and a
    directive without one (``%ignore``, ``%import``) ends with its line."""
    name = _NAME.match(text, i + 1)
    j = name.end() if name else i + 1
    while j < len(text) and text[j] in " \t":
        j += 1
    if j >= len(text) or text[j] != "{":
        return _line_end(text, j) if name and name.group() in ("ignore", "import") else j
    end = _block_end(text, j)
    if name and name.group() == "json":
        block = text[j:end]
        check_json_depth(block, "inline JSON schema")
        try:
            schema = json.loads(block)
        except json.JSONDecodeError:
            return end  # llguidance names the syntax error
        check_schema(schema)
    return end


def _block_end(text: str, i: int) -> int:
    """Index past the JSON object opening at ``text[i]`` (strings skipped)."""
    depth = 0
    while i < len(text):
        ch = text[i]
        if ch == '"':
            i = _string_end(text, i)
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(text)


def _check_depth(rules: dict[str, _Rule]) -> None:
    """The longest chain of rules naming rules from any rule (recursion cut), iteratively, memoised."""
    depth: dict[str, int] = {}
    for top in rules:
        if top in depth:
            continue
        on_path: set[str] = {top}
        stack: list[tuple[str, int]] = [(top, 0)]
        while stack:
            name, child = stack[-1]
            names = rules[name].names
            if child < len(names):
                stack[-1] = (name, child + 1)
                nxt = names[child]
                if nxt in rules and nxt not in depth and nxt not in on_path:
                    on_path.add(nxt)
                    stack.append((nxt, 0))
                continue
            stack.pop()
            on_path.discard(name)
            depth[name] = 1 + max((depth.get(c, 0) for c in names if c in rules and c not in on_path), default=0)
            if depth[name] > MAX_DEPTH:
                raise GrammarLimitError(f"the grammar's rules chain more than {MAX_DEPTH} deep from rule {name} "
                                        f"down; at most {MAX_DEPTH}")

"""What a structured-output grammar may cost, checked before anything compiles it.

llguidance hits its limits *while generating*: a repetition count it expands (``a{1000000}``,
``"a"~1000000``), a rule with more alternatives than an Earley row holds, or a chain of rules or
``$ref`` s deep enough to overflow the compiler's stack (a SIGSEGV, not an error). Such a grammar would
pass every check at intake and fail mid-answer, or take its process down. So the front door measures
every spec first, in pure Python and without recursion, and refuses one past these limits with a
:class:`GrammarLimitError` (an HTTP 400) naming the limit:

* repetitions: every ``{m,n}`` and ``~ n`` copies its operand, and nested ones multiply; at most
  :data:`MAX_REPEAT` copies in all (llguidance: ~1 us per copy per step; 50,000 fail);
* nesting: a schema followed through its ``$ref`` s, or a Lark rule chain, at most :data:`MAX_DEPTH`
  deep (the compiler recurses; ~2,500 levels overflow an 8 MiB stack), and a JSON text at most
  :data:`MAX_JSON_NESTING` (the request body's own limit);
* size: at most :data:`MAX_RULES` Lark rules, :data:`MAX_ALTERNATIVES` alternatives in one rule
  (the Earley row limit is 2,000 items) and :data:`MAX_CHOICES` choices;
* a schema that admits no value (a ``$ref`` cycle with no way out) is refused: the model could start
  writing it and never finish (``schema_limits``).
"""

from __future__ import annotations

import re

MAX_REPEAT = 10_000
MAX_DEPTH = 128
MAX_JSON_NESTING = 64
MAX_RULES = 1_000
MAX_ALTERNATIVES = 1_000
MAX_CHOICES = 10_000


class GrammarLimitError(ValueError):
    """A structured-output spec is past a limit this server sets (a 400 naming it)."""


def json_depth(text: str) -> int:
    """How deeply a JSON text nests (arrays and objects), read without parsing it (no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def check_json_depth(text: str, what: str) -> None:
    if (depth := json_depth(text)) > MAX_JSON_NESTING:
        raise GrammarLimitError(f"the {what} nests {depth} levels deep; at most {MAX_JSON_NESTING}")


_COUNT = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")


def regex_repeats(pattern: str) -> int:
    """Copies a regex's counted repetitions make: ``x{m}``, ``x{m,}`` and ``x{m,n}`` copy ``x`` max(m, n)
    times, a counted group copies what its inside copies (``(a{10}){10}`` is 100), and the counts of a
    regex add up. ``*``, ``+`` and ``?`` are loops, not copies. Escapes and character classes (Rust's
    nested ones too) are single atoms."""
    frames = [0]  # copies counted so far in each open group, innermost last
    pending: int | None = None  # copies inside the group that just closed: its count, if one follows, multiplies them
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "{" and (m := _COUNT.match(pattern, i)):
            count = max(int(m.group(1)), int(m.group(3) or 0))
            pending = count * max(1, pending) if pending is not None else count  # a count may follow
            i = m.end()
            continue
        if pending is not None:
            frames[-1] += pending
            pending = None
        if ch == "\\":
            i += 2
            if pattern[i - 1:i] in ("p", "P", "x", "u", "U") and pattern[i:i + 1] == "{":
                i = pattern.find("}", i) + 1 or n
        elif ch == "[":
            i = _class_end(pattern, i)
        elif ch == "(":
            frames.append(0)
            i += 1
        elif ch == ")" and len(frames) > 1:
            pending = frames.pop()
            i += 1
        else:
            i += 1
    return sum(frames) + (pending or 0)


def _class_end(pattern: str, i: int) -> int:
    """Index just past the character class opening at ``pattern[i]`` (``[...]``, nested ``[`` allowed)."""
    depth, i = 0, i
    n = len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            depth += 1
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":  # a leading ] is a literal
                i += 1
            continue
        if ch == "]":
            depth -= 1
            i += 1
            if depth == 0:
                return i
            continue
        i += 1
    return n


def check_regex(pattern: str, what: str = "regex") -> None:
    if (copies := regex_repeats(pattern)) > MAX_REPEAT:
        raise GrammarLimitError(f"the {what} repeats {copies} copies in all (counted repetitions such as {{n}}, "
                                f"multiplied where nested); at most {MAX_REPEAT}")


def check_choices(choices: list[str]) -> None:
    if len(choices) > MAX_CHOICES:
        raise GrammarLimitError(f"guided_choice has {len(choices)} choices; at most {MAX_CHOICES}")

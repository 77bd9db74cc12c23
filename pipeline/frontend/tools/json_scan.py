"""Where JSON values end in text that is still being generated.

A tool call's arguments are streamed as the model writes them, so the parsers need to know, in a
possibly unfinished text, where a JSON value starts and whether it has ended yet, without parsing
it (it may be cut anywhere). Strings, escapes and nesting are tracked; nothing else is validated:
a finished value is checked with ``json.loads`` by whoever uses it.
"""

from __future__ import annotations

import json

WHITESPACE = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value starting at ``text[start]`` (no leading whitespace), or None
    while it is unfinished. A bare scalar (number, true, ...) ends at the first delimiter after it; at
    the end of the text it is unfinished, since more digits may follow."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first not in _CLOSE:
        i = start
        while i < len(text) and text[i] not in ",}] \t\r\n":
            i += 1
        return i if i < len(text) else None
    stack = [_CLOSE[first]]
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if c in _CLOSE:
            stack.append(_CLOSE[c])
        elif c in "}]":
            if c != stack.pop():
                return i + 1  # mismatched: the value is over (json.loads will refuse it)
            if not stack:
                return i + 1
        i += 1
    return None


def _string_end(text: str, start: int) -> int | None:
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def object_members(text: str, start: int) -> list[tuple[str, int, int | None]]:
    """The members of the (maybe unfinished) JSON object at ``text[start] == "{"``, as (key, value
    start, value end or None while unfinished), in order, up to where the text stops. A key still
    being written, or one whose value has not begun, is not listed."""
    out: list[tuple[str, int, int | None]] = []
    i = skip_ws(text, start + 1)
    while i < len(text) and text[i] == '"':
        key_end = _string_end(text, i)
        if key_end is None:
            break
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            break
        i = skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            break
        i = skip_ws(text, i + 1)
        if i >= len(text):
            break
        end = value_end(text, i)
        out.append((key, i, end))
        if end is None:
            break
        i = skip_ws(text, end)
        if i >= len(text) or text[i] != ",":
            break
        i = skip_ws(text, i + 1)
    return out

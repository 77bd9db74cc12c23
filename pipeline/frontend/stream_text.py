"""Text a stream may send before its model has finished writing: a marker cut at the end of what is written so
far is held back, since the next token may complete it (the reasoning, harmony and tool-call readers all hold
back this way, so what they send is a prefix of what the finished answer gives)."""

from __future__ import annotations


def held_back(text: str, marker: str) -> str:
    """``text`` without a trailing start of ``marker``."""
    for j in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:j]):
            return text[:-j]
    return text


def open_marker_held_back(text: str) -> str:
    """``text`` without a trailing ``<|...`` that is not closed yet (harmony's special-token markers)."""
    at = text.rfind("<|")
    if at >= 0 and "|>" not in text[at:]:
        return text[:at]
    return held_back(text, "<|")

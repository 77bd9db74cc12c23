"""Incremental detokenization: decode a short window per new token, not the whole output.

Re-decoding all output ids every step costs O(n) per token (O(n^2) per request). Decoding
``ids[prefix_offset:]`` against ``ids[prefix_offset:read_offset]`` gives the same text as a
full decode while keeping context for tokenizers whose pieces depend on their left neighbour,
and holds back an incomplete UTF-8 sequence until a later token completes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

Decode = Callable[[list[int]], str]


@dataclass
class IncrementalDetokenizer:
    prefix_offset: int = 0  # start of the decode window (context for the new pieces)
    read_offset: int = 0  # ids before this are already turned into text

    def step(self, decode: Decode, ids: list[int], final: bool = False) -> str:
        """Text that the ids since the last call add; with ``final`` also a dangling partial character."""
        if self.read_offset >= len(ids):
            return ""
        prefix_text = decode(ids[self.prefix_offset : self.read_offset])
        new_text = decode(ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)
        return new_text[len(prefix_text) :]

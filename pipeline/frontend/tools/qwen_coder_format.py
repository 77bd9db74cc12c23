"""Qwen3-Coder's and Qwen3.5's tool calls (``qwen3_coder``), XML-like, read by the request's declared types."""

from __future__ import annotations

import json
from typing import Any

from strata.pipeline.frontend.tools.format_base import ParsedCall
from strata.pipeline.frontend.tools.request import ToolFunction
from strata.pipeline.frontend.tools.typed_values import TypedValueFormat


class Qwen3Coder(TypedValueFormat):
    """One ``<tool_call>`` block per call holding a ``<function=NAME>`` element with a ``<parameter=KEY>``
    element per argument: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
    </function>\\n</tool_call>``. As MiniMax-M2's, a value is bare text for a string parameter and JSON for any
    other (``typed_values``; the newline either side of it is the template's)."""

    name = "qwen3_coder"
    start, end = "<tool_call>", "</tool_call>"
    function, function_end = "<function=", "</function>"
    arg_open, key_close, value_open, value_close, call_close = "<parameter=", ">", "", "</parameter>", function_end
    markers = (start, end)
    signature = "<function="

    def _calls(self, rest: str) -> list[ParsedCall]:
        def blocks():
            for block in rest.split(self.start):
                at = block.find(self.function)
                name, named, body = block[at + len(self.function):].partition(">") if at >= 0 else ("", "", "")
                yield (name if named else None), body
        return self._read(blocks())

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        lines = self._call_rules(functions, lambda f, arguments: f"{json.dumps(chr(10) + self.function + f.name + '>' + chr(10))} "
                                                                 f"{arguments} {json.dumps(self.function_end + chr(10))} "
                                                                 f"{self.lit(self.end)}")
        return [f"call ({json.dumps(chr(10))} {self.lit(self.start)} call)*" if parallel else "call", *lines]

    def _grammar_head(self, key: str, schema: dict[str, Any]) -> str:
        return json.dumps(f"{self.arg_open}{key}{self.key_close}\n")

    def _grammar_close(self) -> str:
        return json.dumps(f"\n{self.value_close}\n")

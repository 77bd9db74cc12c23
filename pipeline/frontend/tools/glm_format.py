"""GLM-4.5's tool calls (``glm45``, also GLM-4.6 and GLM-5), read by the request's declared parameter types."""

from __future__ import annotations

import json
from typing import Any

from strata.pipeline.frontend.tools.format_base import ParsedCall
from strata.pipeline.frontend.tools.request import ToolFunction
from strata.pipeline.frontend.tools.typed_values import TypedValueFormat


class Glm45(TypedValueFormat):
    """GLM's calls, one ``<tool_call>`` block each, the function's name first, then a key and a value per
    argument: ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>``,
    blocks joined by a newline. As MiniMax-M2's, a value is bare text for a string parameter and JSON for any
    other (``typed_values``), and the arguments are written as JSON text an argument at a time."""

    name = "glm45"
    start, end = "<tool_call>", "</tool_call>"
    arg_open, key_close, value_open, value_close, call_close = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", end
    markers = (start, end, arg_open, key_close, value_open, value_close)
    signature = "<arg_key>"

    def _calls(self, rest: str) -> list[ParsedCall]:
        def blocks():
            for block in rest.split(self.start):
                ends = [i for i in (block.find("\n"), block.find(self.arg_open), block.find(self.end)) if i >= 0]
                yield (block[: min(ends)].strip() if ends else None), block[min(ends, default=0):]
        return self._read(blocks())

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        lines = self._call_rules(functions, lambda f, arguments: f"{json.dumps(f.name + chr(10))} {arguments} "
                                                                 f"{self.lit(self.end)}")
        return [f"call ({json.dumps(chr(10))} {self.lit(self.start)} call)*" if parallel else "call", *lines]

    def _grammar_head(self, key: str, schema: dict[str, Any]) -> str:
        return f"{self.lit(self.arg_open)} {json.dumps(key)} {self.lit(self.key_close)} {json.dumps(chr(10))} " \
               f"{self.lit(self.value_open)}"

    def _grammar_close(self) -> str:
        return f"{self.lit(self.value_close)} {json.dumps(chr(10))}"

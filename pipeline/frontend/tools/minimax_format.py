"""MiniMax-M2's XML-like calls (``minimax_m2``), read by the request's declared parameter types."""

from __future__ import annotations

import json
from typing import Any

from strata.pipeline.frontend.tools.format_base import ParsedCall
from strata.pipeline.frontend.tools.request import ToolFunction
from strata.pipeline.frontend.tools.typed_values import TypedValueFormat


class MiniMaxM2(TypedValueFormat):
    """MiniMax-M2's calls, XML-like, one ``<invoke>`` per call and one ``<parameter>`` per argument:
    ``<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE</parameter>\n...</invoke>\n...
    </minimax:tool_call>``. A value is the bare text for a string parameter, JSON for any other, so reading it
    takes the request's schemas (``typed_values``). The arguments are written as JSON text a parameter at a
    time (``{"KEY": VALUE, ...}``, each step a prefix of the whole), so a stream's deltas add up to the whole
    answer's arguments."""

    name = "minimax_m2"
    start, end = "<minimax:tool_call>", "</minimax:tool_call>"
    invoke, invoke_end = '<invoke name="', "</invoke>"
    arg_open, key_close, value_open, value_close, call_close = '<parameter name="', '">', "", "</parameter>", invoke_end
    markers = (start, end)
    signature = "<minimax:tool_call>"

    def _calls(self, rest: str) -> list[ParsedCall]:
        def blocks():
            for block in rest.split(self.invoke)[1:]:
                name, named, body = block.partition('">')
                yield (name if named else None), body
        return self._read(blocks())

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        lines = self._call_rules(functions, lambda f, arguments: f"{json.dumps(self.invoke + f.name + chr(34) + '>' + chr(10))} "
                                                                 f"{arguments} {json.dumps(self.invoke_end + chr(10))}")
        return [f'"\\n" {"call+" if parallel else "call"} {self.lit(self.end)}', *lines]

    def _grammar_head(self, key: str, schema: dict[str, Any]) -> str:
        return json.dumps(f"{self.arg_open}{key}{self.key_close}")

    def _grammar_close(self) -> str:
        return json.dumps(self.value_close + "\n")

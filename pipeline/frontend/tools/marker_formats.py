"""Families whose calls are framed by special-token markers: ``kimi_k2`` (``functions.NAME:IDX`` and JSON
arguments) and ``deepseek_v3`` (the name, then the arguments in a fenced json block)."""

from __future__ import annotations

import json

from strata.pipeline.frontend.tools.format_base import ParsedCall, ToolFormat, json_schema_rule, stable_text
from strata.pipeline.frontend.tools.request import ToolFunction


class KimiK2(ToolFormat):
    name = "kimi_k2"
    start = "<|tool_calls_section_begin|>"
    end = "<|tool_calls_section_end|>"
    call_begin, argument_begin, call_end = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    markers = (start, end, call_begin, argument_begin, call_end)
    signature = "<|tool_calls_section_begin|>"

    def _calls(self, rest: str) -> list[ParsedCall]:
        calls = []
        for block in rest.split(self.call_begin)[1:]:
            head, sep, arguments = block.partition(self.argument_begin)
            if not sep:
                break
            call_id = head.strip()  # functions.NAME:IDX
            name = call_id.split(".", 1)[-1].rsplit(":", 1)[0]
            body, done, _ = arguments.partition(self.call_end)
            calls.append(ParsedCall(name, body.strip() if done else stable_text(body, self.call_end).lstrip(),
                                    call_id))
        return calls

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        lines = [f"call: {' | '.join(f'call_{i}' for i in range(len(functions)))}", "INDEX: /[0-9]{1,4}/"]
        for i, f in enumerate(functions):
            lines.append(f"call_{i}: {self.lit(self.call_begin)} {json.dumps('functions.' + f.name + ':')} INDEX "
                         f"{self.lit(self.argument_begin)} {json_schema_rule(f.parameters)} {self.lit(self.call_end)}")
        return [f"{'call+' if parallel else 'call'} {self.lit(self.end)}", *lines]


class DeepSeekV3(ToolFormat):
    """DeepSeek-V3's calls: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the
    arguments in a fenced json block, ``<｜tool▁call▁end｜>``, ...,  ``<｜tool▁calls▁end｜>``."""

    name = "deepseek_v3"
    start, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, sep, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    markers = (start, end, call_begin, sep, call_end)
    signature = "<｜tool▁calls▁begin｜>"
    fence_open, fence_close = "```json\n", "\n```"

    def _calls(self, rest: str) -> list[ParsedCall]:
        calls = []
        for block in rest.split(self.call_begin)[1:]:
            _, found, after = block.partition(self.sep)
            name, newline, body = after.partition("\n")
            if not found or not newline:
                break
            arguments = body.split(self.call_end)[0].partition(self.fence_open.strip("\n"))[2]
            arguments, closed, _ = arguments.partition(self.fence_close)
            calls.append(ParsedCall(name.strip(), arguments.strip() if closed else
                                    stable_text(arguments, self.fence_close).lstrip()))
        return calls

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        lines = [f"call: {' | '.join(f'call_{i}' for i in range(len(functions)))}"]
        for i, f in enumerate(functions):
            lines.append(f"call_{i}: {self.lit(self.call_begin)} \"function\" {self.lit(self.sep)} "
                         f"{json.dumps(f.name + chr(10) + self.fence_open)} {json_schema_rule(f.parameters)} "
                         f"{json.dumps(self.fence_close)} {self.lit(self.call_end)}")
        return [f"{'call+' if parallel else 'call'} {self.lit(self.end)}", *lines]

"""gpt-oss's calls (``openai``): harmony messages addressed to a function."""

from __future__ import annotations

import json

from strata.pipeline.frontend.harmony import CONSTRAIN, ENDS, FUNCTIONS, MESSAGE, harmony_messages
from strata.pipeline.frontend.tools.format_base import ParsedCall, ParsedOutput, ToolFormat, json_schema_rule
from strata.pipeline.frontend.tools.request import ToolFunction


class HarmonyCalls(ToolFormat):
    """gpt-oss's calls: harmony messages addressed to a function (``frontend.harmony``), ``<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|>``; the content is the final channel's text
    (and a preamble addressed to no one), never the analysis. The calls' markers open every harmony message,
    so no trigger can tell a call from the analysis: ``auto`` reads calls as the model writes them, unenforced
    (``enforces_auto``), while ``required`` and a named function start the answer at a call."""

    name = "openai"
    start = "<|channel|>"
    markers = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
    signature = FUNCTIONS
    enforces_auto = False
    reads_whole_output = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        if MESSAGE not in text:  # no harmony message (yet)
            return ParsedOutput(text if final else "")
        content, calls = [], []
        for message in harmony_messages(text, final):
            recipient = message.recipient
            if recipient is not None and recipient.startswith("functions."):
                calls.append(ParsedCall(recipient[len("functions."):], message.body))
            elif recipient is None and message.channel != "analysis":
                content.append(message.body)
        return ParsedOutput("".join(content), calls)

    def _after_start(self, functions: tuple[ToolFunction, ...], parallel: bool) -> list[str]:
        lines = [f"call: {' | '.join(f'call_{i}' for i in range(len(functions)))}"]
        for i, f in enumerate(functions):  # one call: <|call|> ends the model's turn
            lines.append(f"call_{i}: {json.dumps('commentary ' + FUNCTIONS + f.name + ' ')} {self.lit(CONSTRAIN)} "
                         f'"json" {self.lit(MESSAGE)} {json_schema_rule(f.parameters)} {self.lit(ENDS[2])}')
        return ["call", *lines]

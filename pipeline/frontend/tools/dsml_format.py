"""DeepSeek-V3.2's tool calls (``deepseek_v32``): DSML, XML-like elements that say whether a value is text."""

from __future__ import annotations

import json
from typing import Any

from strata.pipeline.frontend.tools.minimax_format import MiniMaxM2
from strata.pipeline.frontend.tools.typed_values import is_text


class DeepSeekV32(MiniMaxM2):
    """``<｜DSML｜function_calls>`` then per call ``<｜DSML｜invoke name="NAME">`` with one
    ``<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`` per argument, bare text where
    ``string`` is true and JSON otherwise, ``</｜DSML｜invoke>``, and ``</｜DSML｜function_calls>`` after the last.
    MiniMax-M2's layout with other markers and a type on each value: the attribute and the request's schema say
    the same for a model that follows its schema; reading takes the attribute (what the model meant), a grammar
    writes it from the schema."""

    name = "deepseek_v32"
    start, end = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
    invoke, invoke_end = '<｜DSML｜invoke name="', "</｜DSML｜invoke>"
    arg_open, key_close, value_open, value_close, call_close = ('<｜DSML｜parameter name="', '"', ">",
                                                                "</｜DSML｜parameter>", invoke_end)
    markers = (start, end)
    signature = "｜DSML｜"

    def _argument(self, function: str, key: str, attributes: str, raw: str) -> Any:
        """Typed by its ``string`` attribute where it has one (true: the text; false: JSON), else as the base."""
        if 'string="true"' in attributes:
            return raw
        if 'string="false"' in attributes:
            try:
                return json.loads(raw)
            except ValueError:
                return raw
        return self._value(function, key, raw)

    def _grammar_head(self, key: str, schema: dict[str, Any]) -> str:
        return json.dumps(f'{self.arg_open}{key}" string="{"true" if is_text(schema) else "false"}">')


"""How each model family writes tool calls: reading them from its output, and the grammar that makes
it write them well-formed.

One class per family, named as vLLM's ``--tool-call-parser`` names them (in ``json_formats``, ``marker_formats``,
``minimax_format``, ``dsml_format``, ``glm_format``, ``qwen_coder_format`` and ``harmony_format``, over ``format_base``; this module lists them and finds a template's):

- ``hermes`` (Qwen2.5 / Qwen3, Hermes, and most chatml models):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call;
- ``llama3_json`` (Llama 3.1+): ``{"name": ..., "parameters": {...}}`` as the whole answer, calls joined
  by ``; `` (an optional ``<|python_tag|>`` first);
- ``mistral`` (Mistral / Mixtral v3 tokenizers): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
- ``kimi_k2`` (Kimi-K2 / K2.5): ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``;
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and the arguments
  in a fenced json block, ``<｜tool▁call▁end｜>``, ..., ``<｜tool▁calls▁end｜>``;
- ``minimax_m2``: ``<minimax:tool_call>`` then per call ``<invoke name="NAME">`` with one
  ``<parameter name="KEY">VALUE</parameter>`` per argument (bare text for strings, JSON otherwise);
- ``deepseek_v32`` (DeepSeek-V3.2's DSML): ``<｜DSML｜function_calls>`` then per call ``<｜DSML｜invoke
  name="NAME">`` with one ``<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`` per
  argument (the attribute types the value);
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): per call ``<tool_call>`` then ``<function=NAME>`` with one
  ``<parameter=KEY>VALUE</parameter>`` per argument (typed as MiniMax-M2's), ``</function></tool_call>``;
- ``glm45`` (GLM-4.5 / 4.6, GLM-5): per call ``<tool_call>NAME`` then ``<arg_key>KEY</arg_key>`` and
  ``<arg_value>VALUE</arg_value>`` per argument (typed as MiniMax-M2's), ``</tool_call>``;
- ``openai`` (gpt-oss): a harmony message addressed ``to=functions.NAME`` whose body is the arguments.

``parse`` reads a possibly unfinished output, so the same code serves whole answers and streams: the
content that can no longer change, and each call's name and its arguments as far as written (the
arguments are the model's own JSON text, so what a stream sends adds up to what a whole answer holds).

``grammar`` is the Lark grammar (llguidance) of an answer the request allows: for ``required`` or a named
function, only calls; for ``auto``, free text or calls. With ``auto`` and an opening marker that is one token
(Qwen's ``<tool_call>``, Mistral's, Kimi-K2's), ``calls.constrain`` makes that token the grammar's trigger:
the text before it is unconstrained and costs no mask. Otherwise the calls are triggered lazily by the marker's
text inside the grammar. Either way a call, once begun, names a declared function and its arguments satisfy that function's
parameters schema. A marker that is one added token of the checkpoint's tokenizer is written in the grammar
by its id; one that is a special token makes the answer detokenize with special tokens kept, or the
marker would vanish from the text.
"""

from __future__ import annotations

from typing import Any

from strata.pipeline.frontend.tools.dsml_format import DeepSeekV32
from strata.pipeline.frontend.tools.format_base import ParsedCall, ParsedOutput, ToolFormat
from strata.pipeline.frontend.tools.glm_format import Glm45
from strata.pipeline.frontend.tools.harmony_format import HarmonyCalls
from strata.pipeline.frontend.tools.json_formats import Hermes, Llama3Json, Mistral
from strata.pipeline.frontend.tools.marker_formats import DeepSeekV3, KimiK2
from strata.pipeline.frontend.tools.minimax_format import MiniMaxM2
from strata.pipeline.frontend.tools.qwen_coder_format import Qwen3Coder

__all__ = ["TOOL_FORMATS", "DeepSeekV3", "DeepSeekV32", "Glm45", "HarmonyCalls", "Hermes", "KimiK2", "Llama3Json", "MiniMaxM2", "Mistral", "Qwen3Coder",
           "ParsedCall", "ParsedOutput", "ToolFormat", "detect_tool_format", "tool_format_for"]


TOOL_FORMATS: dict[str, type[ToolFormat]] = {f.name: f for f in (Hermes, Llama3Json, Mistral, KimiK2, DeepSeekV3,
                                                                   DeepSeekV32, MiniMaxM2, Glm45, Qwen3Coder, HarmonyCalls)}


def detect_tool_format(chat_template: str | None) -> str | None:
    """The family a chat template writes tool calls in (None: it renders no tools, or none we know)."""
    if not chat_template or "tools" not in chat_template:
        return None
    for fmt in (HarmonyCalls, KimiK2, DeepSeekV3, DeepSeekV32, MiniMaxM2, Glm45, Qwen3Coder, Mistral, Hermes,
                Llama3Json):  # most specific first
        if fmt.signature in chat_template:
            return fmt.name
    return None


def tool_format_for(parser: str, hf_tokenizer: Any) -> ToolFormat | None:
    """The tool-call format a server reads: ``parser`` names one, ``auto`` reads it off the chat template,
    ``none`` turns tool calling off."""
    if parser == "none":
        return None
    name = detect_tool_format(getattr(hf_tokenizer, "chat_template", None)) if parser == "auto" else parser
    if name is None:
        return None
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; expected auto, none or one of {', '.join(TOOL_FORMATS)}")
    return TOOL_FORMATS[name](hf_tokenizer)

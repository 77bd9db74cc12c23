"""Tools-capable chat templates for the tiny text checkpoints, one per tool-call family.

Each renders the tools into the prompt, the assistant's earlier calls in the family's own syntax and
``role: tool`` results, in the tiny models' ``role: content`` layout. Markers are added to the tokenizer
as real checkpoints have them: Hermes' ``<tool_call>`` as plain added tokens (as Qwen2.5), Mistral's
``[TOOL_CALLS]``, Kimi-K2's and DeepSeek-V3's markers and DeepSeek-V3.2's ``<｜DSML｜function_calls>`` pair as special tokens, MiniMax-M2's
``<minimax:tool_call>`` pair, GLM's six markers and Qwen3.5's ``<tool_call>`` pair as plain added tokens, gpt-oss's harmony markers as special tokens; Llama 3's JSON
calls need none.
"""

from __future__ import annotations

from typing import Any

_TOOLS = (
    "{%- if tools -%}{{- 'system: functions you may call:\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}{%- endif -%}"
)
_HEAD = "{{- '<s>' -}}" + _TOOLS + "{%- for message in messages -%}"
_TAIL = ("{%- endfor -%}"
         "{%- if add_generation_prompt -%}{{- 'assistant:' -}}{%- endif -%}")
_TEXT = ("{{- message['role'] + ': ' + (message['content'] or '') -}}"
         "{%- if message['role'] == 'assistant' -%}{{- '</s>' -}}{%- endif -%}{{- '\\n' -}}")


def _with_calls(call: str, sep: str = "", before: str = "", after: str = "") -> str:
    """Assistant turns with tool_calls render ``before`` + each call (joined by ``sep``) + ``after``."""
    return ("{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}"
            "{{- 'assistant: ' + (message['content'] or '') + '" + before + "' -}}"
            "{%- for tc in message['tool_calls'] -%}{%- if not loop.first -%}{{- '" + sep + "' -}}{%- endif -%}"
            + call + "{%- endfor -%}{{- '" + after + "</s>\\n' -}}"
            "{%- elif message['role'] == 'tool' -%}{{- 'tool: ' + message['content'] + '\\n' -}}"
            "{%- else -%}" + _TEXT + "{%- endif -%}")


_ARGS = "(tc['function']['arguments'] | tojson)"
TOOL_TEMPLATES: dict[str, str] = {
    "hermes": _HEAD + _with_calls(
        "{{- '<tool_call>\\n{\"name\": \"' + tc['function']['name'] + '\", \"arguments\": ' + " + _ARGS
        + " + '}\\n</tool_call>' -}}", sep="\\n") + _TAIL,
    "llama3_json": _HEAD + _with_calls(
        "{{- '{\"name\": \"' + tc['function']['name'] + '\", \"parameters\": ' + " + _ARGS + " + '}' -}}",
        sep="; ") + _TAIL,
    "mistral": _HEAD + _with_calls(
        "{{- '{\"name\": \"' + tc['function']['name'] + '\", \"arguments\": ' + " + _ARGS + " + '}' -}}",
        sep=", ", before="[TOOL_CALLS][", after="]") + _TAIL,
    "kimi_k2": _HEAD + _with_calls(
        "{{- '<|tool_call_begin|>functions.' + tc['function']['name'] + ':' + (loop.index0 | string)"
        " + '<|tool_call_argument_begin|>' + " + _ARGS + " + '<|tool_call_end|>' -}}",
        before="<|tool_calls_section_begin|>", after="<|tool_calls_section_end|>") + _TAIL,
    "deepseek_v3": _HEAD + _with_calls(
        "{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + tc['function']['name'] + '\\n```json\\n' + " + _ARGS
        + " + '\\n```<｜tool▁call▁end｜>' -}}",
        before="<｜tool▁calls▁begin｜>", after="<｜tool▁calls▁end｜>") + _TAIL,
    "minimax_m2": _HEAD + _with_calls(
        "{{- '<invoke name=\"' + tc['function']['name'] + '\">\\n' -}}"
        "{%- for k, v in tc['function']['arguments'].items() -%}"
        "{{- '<parameter name=\"' + k + '\">' + (v if v is string else v | tojson) + '</parameter>\\n' -}}"
        "{%- endfor -%}{{- '</invoke>\\n' -}}",
        before="<minimax:tool_call>\\n", after="</minimax:tool_call>") + _TAIL,
    "glm45": _HEAD + _with_calls(
        "{{- '\\n<tool_call>' + tc['function']['name'] + '\\n' -}}"
        "{%- for k, v in tc['function']['arguments'].items() -%}"
        "{{- '<arg_key>' + k + '</arg_key>\\n<arg_value>' + (v if v is string else v | tojson) + '</arg_value>\\n' -}}"
        "{%- endfor -%}{{- '</tool_call>' -}}") + _TAIL,
    "deepseek_v32": _HEAD + _with_calls(
        "{{- '<｜DSML｜invoke name=\"' + tc['function']['name'] + '\">\\n' -}}"
        "{%- for k, v in tc['function']['arguments'].items() -%}"
        "{{- '<｜DSML｜parameter name=\"' + k + '\" string=\"' + ('true' if v is string else 'false') + '\">'"
        " + (v if v is string else v | tojson) + '</｜DSML｜parameter>\\n' -}}"
        "{%- endfor -%}{{- '</｜DSML｜invoke>\\n' -}}",
        before="<｜DSML｜function_calls>\\n", after="</｜DSML｜function_calls>") + _TAIL,
    "qwen3_coder": _HEAD + _with_calls(
        "{{- '\\n<tool_call>\\n<function=' + tc['function']['name'] + '>\\n' -}}"
        "{%- for k, v in tc['function']['arguments'].items() -%}"
        "{{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' -}}"
        "{%- endfor -%}{{- '</function>\\n</tool_call>' -}}") + _TAIL,
    "openai": _HEAD + _with_calls(
        "{{- '<|start|>assistant<|channel|>commentary to=functions.' + tc['function']['name'] + ' <|constrain|>json"
        "<|message|>' + " + _ARGS + " + '<|call|>' -}}") + _TAIL,
}
# the family's markers: (text, special)
TOOL_MARKERS: dict[str, tuple[tuple[str, bool], ...]] = {
    "hermes": (("<tool_call>", False), ("</tool_call>", False)),
    "llama3_json": (),
    "mistral": (("[TOOL_CALLS]", True),),
    "kimi_k2": tuple((m, True) for m in ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                          "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")),
    "deepseek_v3": tuple((m, True) for m in ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                              "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")),
    # MiniMax-M2's vocabulary also holds its thinking tags as single tokens
    "minimax_m2": (("<minimax:tool_call>", False), ("</minimax:tool_call>", False), ("<think>", False),
                   ("</think>", False)),
    # GLM-4.5's markers are added tokens, not special ones (its answers detokenize with them)
    "glm45": tuple((m, False) for m in ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                         "</arg_value>")),
    "deepseek_v32": (("<｜DSML｜function_calls>", True), ("</｜DSML｜function_calls>", True)),
    "qwen3_coder": (("<tool_call>", False), ("</tool_call>", False)),  # as Qwen3.5's vocabulary has them
    "openai": tuple((m, True) for m in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                                         "<|return|>", "<|call|>")),
}


def add_tool_template(tok: Any, family: str) -> None:
    """Give a tiny tokenizer ``family``'s tool markers and tools-capable chat template."""
    from tokenizers import AddedToken

    if family not in TOOL_TEMPLATES:
        raise ValueError(f"unknown tool-call family {family!r}; expected one of {', '.join(TOOL_TEMPLATES)}")
    for text, special in TOOL_MARKERS[family]:
        tok.add_tokens([AddedToken(text, special=special, normalized=False)], special_tokens=special)
    tok.chat_template = TOOL_TEMPLATES[family]

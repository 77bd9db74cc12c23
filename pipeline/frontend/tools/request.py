"""A request's ``tools`` and ``tool_choice``, checked: which functions the model may call, and whether
it may (``auto``), must (``required``, a named function) or must not (``none``) call one.

Everything a client can get wrong is a ``ValueError`` naming it (an HTTP 400): a tool that is not a
function, a bad or repeated name, parameters that are not a JSON-schema object, a ``tool_choice``
naming a function that is not among the tools. The parameters schemas themselves are compiled into the
grammar that enforces them (``formats``), and a schema llguidance refuses is a 400 there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolFunction:
    name: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object
    description: str | None = None

    def template_entry(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's shape)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    functions: tuple[ToolFunction, ...]
    choice: str  # auto | none | required | function
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: more than one call per answer

    @property
    def parses_calls(self) -> bool:
        """Whether the answer is read for tool calls (``none``: it is plain text, as OpenAI does)."""
        return self.choice != "none"

    def callable_functions(self) -> tuple[ToolFunction, ...]:
        return tuple(f for f in self.functions if f.name == self.named) if self.named else self.functions

    def template_tools(self) -> list[dict[str, Any]]:
        return [f.template_entry() for f in self.functions]


def tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest | None:
    """The checked tools of a chat request; None when it has none (and sets no tool_choice)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools: the request declares no function to call")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ValueError(f"tools must be a list of at most {MAX_TOOLS} function tools")
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError("parallel_tool_calls must be true or false")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolRequest(functions, tool_choice or "auto", None, parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
            isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
        return ToolRequest(functions, "function", name, False)
    raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def _function(i: int, tool: Any) -> ToolFunction:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ValueError(f'{where} must be {{"type": "function", "function": {{...}}}}')
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a string")
    params = fn.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ValueError(f"{where}.function.parameters must be a JSON schema of an object")
    return ToolFunction(name, params, description)

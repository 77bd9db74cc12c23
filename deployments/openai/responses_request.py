"""The OpenAI Responses API's request (``POST /v1/responses``), read into the chat request it asks for.

A response runs on the chat path (template, tools, structured output, reasoning, the engine), so this
module only translates: ``instructions`` and ``input`` items (messages with ``input_text`` / ``input_image``
parts, earlier ``function_call`` items and their ``function_call_output``) become chat messages, flat
function tools become chat tools, ``text.format`` becomes ``response_format`` and ``max_output_tokens`` the
completion limit. What a server without storage or hosted tools cannot do (``previous_response_id``,
``background``, built-in tools, files) is a 400 that says so; ``store`` is accepted and nothing is kept.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from strata.deployments.openai.protocol import APIError, LenientModel

# chat field -> the Responses field a client set (an error about the former names the latter)
CHAT_TO_RESPONSES_PARAM = {"max_completion_tokens": "max_output_tokens", "messages": "input",
                           "response_format": "text", "tools": "tools", "tool_choice": "tool_choice"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponsesRequest(LenientModel):
    model: StrictStr
    input: StrictStr | list[dict[StrictStr, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    tools: list[dict[StrictStr, Any]] | None = None
    tool_choice: StrictStr | dict[StrictStr, Any] | None = None
    parallel_tool_calls: StrictBool = True
    text: dict[StrictStr, Any] | None = None
    stream: StrictBool = False
    store: StrictBool = True  # accepted: nothing is stored here (previous_response_id is refused)
    previous_response_id: StrictStr | None = None
    background: StrictBool = False
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request this response runs as."""
        if self.previous_response_id is not None:
            raise APIError(400, "previous_response_id needs stored responses, which this server does not keep: "
                                "send the conversation as input items", param="previous_response_id")
        if self.background:
            raise APIError(400, "background responses are not supported: stream the response instead",
                           param="background")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += _messages(self.input)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p), ("user", self.user),
                            ("max_completion_tokens", self.max_output_tokens)):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
        for name, value in (self.model_extra or {}).items():  # vLLM's sampling extensions pass through
            if name in ("top_k", "repetition_penalty", "seed", "min_tokens", "chat_template_kwargs", "ignore_eos"):
                body[name] = value
        return body


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise APIError(400, f"input[{i}].role must be user, assistant, system or developer", param="input")
            out.append({"role": role, "content": _content(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", i), "type": "function",
                    "function": {"name": _text(item, "name", i), "arguments": _text(item, "arguments", i)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)  # the calls of one turn are one assistant message
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content(output, i)
            out.append({"role": "tool", "tool_call_id": _text(item, "call_id", i), "content": text})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: the chat template decides what a model sees of it
        else:
            raise APIError(400, f"input[{i}] is a {kind!r} item, which this server does not take", param="input")
    return out


def _content(content: Any, i: int) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{i}].content must be a string or a list of parts", param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise APIError(400, f"input[{i}] has a {kind!r} part; this server takes input_text and input_image "
                                "(a data: URL)", param="input")
    return parts


def _text(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"input[{i}].{key} must be a string", param="input")
    return value


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise APIError(400, f"tools[{i}] is a {tool.get('type')!r} tool; this server runs function tools only "
                            "(hosted tools need OpenAI's servers)", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                   param="tool_choice")


def _response_format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text")

"""The OpenAI Responses API's answer, whole or streamed, from the chat answer the same request produced.

Whole: the chat completion becomes a ``response`` object whose ``output`` holds a ``reasoning`` item (when the
model's thinking was read apart), a ``message`` item with its ``output_text`` and one ``function_call`` item
per tool call; a cut by the token limit is ``status: incomplete`` with ``max_output_tokens`` as the reason.

Streamed: each chat chunk becomes the Responses events for it, numbered: ``response.created`` and
``response.in_progress`` first; an item is announced (``response.output_item.added``, then
``response.content_part.added`` for text) when its first delta arrives, its deltas follow
(``response.output_text.delta``, ``response.reasoning_text.delta``, ``response.function_call_arguments.delta``),
and it is closed (``...done`` events) when the next item starts or the answer ends; ``response.completed``
(or ``response.incomplete``) carries the whole response with its usage.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from strata.deployments.openai.responses_request import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _shell(req: ResponsesRequest, rid: str, created: float, status: str) -> dict[str, Any]:
    """The response object's fields that do not depend on the answer."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": req.model,
            "output": [], "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
            "previous_response_id": None, "reasoning": None, "usage": None, "user": req.user}


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _finish(response: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    if finish_reason == "length":
        response["status"], response["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"
    response["completed_at"] = time.time()
    return response


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def whole_response(chat: dict[str, Any], req: ResponsesRequest, rid: str) -> dict[str, Any]:
    """The response object for a whole chat completion (``n`` is 1 here)."""
    choice = chat["choices"][0]
    message = choice["message"]
    response = _shell(req, rid, float(chat["created"]), "completed")
    reasoning = message.get("reasoning_content")
    if reasoning:
        response["output"].append(_reasoning_item(new_id("rs"), reasoning))
    if message.get("content") or not message.get("tool_calls"):
        response["output"].append(_message_item(new_id("msg"), message.get("content") or ""))
    for call in message.get("tool_calls") or []:
        response["output"].append(_call_item(new_id("fc"), call["id"], call["function"]["name"],
                                             call["function"]["arguments"]))
    response["usage"] = _usage(chat.get("usage"))
    return _finish(response, choice.get("finish_reason"))


class ResponseEvents:
    """Turns one streamed chat answer's chunks into Responses events (see the module docstring)."""

    def __init__(self, req: ResponsesRequest, rid: str) -> None:
        self.req, self.response = req, _shell(req, rid, time.time(), "in_progress")
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the item being streamed: its kind, id, index and text so far
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        snapshot = dict(self.response, output=[])
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (the usage chunk has no choices and only sets the usage)."""
        if chunk.get("usage") is not None:
            self.response["usage"] = _usage(chunk["usage"])
        out: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def finish(self) -> list[dict[str, Any]]:
        out = self._close()
        if not self.response["output"]:  # an answer with nothing in it is still one (empty) message
            out += self._text("message", "") + self._close()
        response = _finish(self.response, self.finish_reason)
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + [self.event(done, response=response)]

    # ------------------------------------------------------------ items
    def _text(self, kind: str, delta: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.open is None or self.open["kind"] != kind:
            out += self._close()
            item_id = new_id("msg" if kind == "message" else "rs")
            index = len(self.response["output"])
            self.open = {"kind": kind, "id": item_id, "index": index, "text": ""}
            self.response["output"].append(None)  # its place; filled when it is done
            added = _message_item(item_id, "", "in_progress") if kind == "message" else \
                {"type": "reasoning", "id": item_id, "summary": [], "content": [], "status": "in_progress"}
            out.append(self.event("response.output_item.added", output_index=index, item=added))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} if kind == "message" \
                else {"type": "reasoning_text", "text": ""}
            out.append(self.event("response.content_part.added", item_id=item_id, output_index=index,
                                   content_index=0, part=part))
        self.open["text"] += delta
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        if delta:
            out.append(self.event(name, item_id=self.open["id"], output_index=self.open["index"], content_index=0,
                                   delta=delta, **extra))
        return out

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        item = self.calls.get(call.get("index", 0))
        function = call.get("function") or {}
        if item is None:  # a new call: the chat chunk that opens it carries its id and name
            out += self._close()
            index = len(self.response["output"])
            item = {"kind": "call", "id": new_id("fc"), "index": index, "call_id": call.get("id", new_id("call")),
                    "name": function.get("name", ""), "text": ""}
            self.calls[call.get("index", 0)] = item
            self.open = item
            self.response["output"].append(None)
            out.append(self.event("response.output_item.added", output_index=index,
                                   item=_call_item(item["id"], item["call_id"], item["name"], "", "in_progress")))
        arguments = function.get("arguments") or ""
        if arguments:
            item["text"] += arguments
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=item["index"], delta=arguments))
        return out

    def _close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        i, text = item["index"], item["text"]
        if item["kind"] == "call":
            done = _call_item(item["id"], item["call_id"], item["name"], text)
            self.response["output"][i] = done
            return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                arguments=text),
                    self.event("response.output_item.done", output_index=i, item=done)]
        if item["kind"] == "message":
            done = _message_item(item["id"], text)
            part, text_done = done["content"][0], self.event("response.output_text.done", item_id=item["id"],
                                                              output_index=i, content_index=0, text=text, logprobs=[])
        else:
            done = _reasoning_item(item["id"], text)
            part, text_done = done["content"][0], self.event("response.reasoning_text.done", item_id=item["id"],
                                                              output_index=i, content_index=0, text=text)
        self.response["output"][i] = done
        return [text_done,
                self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                            part=part),
                self.event("response.output_item.done", output_index=i, item=done)]

"""``POST /v1/responses`` around the chat route: the chat answer's HTTP response becomes the Responses one.

The request was translated before the chat route ran (``responses_request``); here its answer is: a whole
chat completion becomes a ``response`` object, a chat stream becomes the Responses event stream (each event
an SSE ``event:`` line and its ``data:``), and an error keeps its status, headers and OpenAI body with the
parameter named as the client sent it. A stream that ends in an error event ends in a Responses ``error``
event, so no client waits for a completion that will not come.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from starlette.responses import JSONResponse, Response, StreamingResponse

from strata.deployments.openai.responses_output import ResponseEvents, new_id, whole_response
from strata.deployments.openai.responses_request import CHAT_TO_RESPONSES_PARAM, ResponsesRequest


async def responses_answer(chat: Response, req: ResponsesRequest) -> Response:
    """The Responses API's answer for the chat route's ``chat`` answer to the translated request."""
    rid = new_id("resp")
    headers = {k: v for k, v in chat.headers.items() if k.lower() not in ("content-length", "content-type")}
    if chat.status_code != 200:
        body = json.loads(bytes(chat.body))
        error = body.get("error") or {}
        if error.get("param") in CHAT_TO_RESPONSES_PARAM:
            error["param"] = CHAT_TO_RESPONSES_PARAM[error["param"]]
        return JSONResponse(body, status_code=chat.status_code, headers=headers)
    if isinstance(chat, StreamingResponse):
        return StreamingResponse(_events(chat.body_iterator, req, rid), media_type="text/event-stream",
                                 headers=headers)
    return JSONResponse(whole_response(json.loads(bytes(chat.body)), req, rid), headers=headers)


async def _events(chunks: AsyncIterator[Any], req: ResponsesRequest, rid: str) -> AsyncIterator[str]:
    events = ResponseEvents(req, rid)
    for event in events.start():
        yield _sse(event)
    pending = ""
    try:
        async for piece in chunks:
            pending += piece.decode() if isinstance(piece, (bytes, bytearray)) else piece
            *lines, pending = pending.split("\n")
            for line in lines:
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    for event in events.finish():
                        yield _sse(event)
                    return
                chunk = json.loads(data)
                if "error" in chunk:  # the chat stream failed: say so, and end
                    err = chunk["error"]
                    yield _sse(events.event("error", code=err.get("code"), message=err.get("message", ""),
                                             param=err.get("param")))
                    return
                for event in events.feed(chunk):
                    yield _sse(event)
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:  # the client left: the chat stream (and its request) ends too
            await close()


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

"""OpenAI's ``n``: one prompt, n answers, the prompt's KV computed once; and several prompts in one
``/v1/completions`` request (each its n choices, indexed prompt by prompt, as vLLM).

The ingress prepares the request once (template, tokens, images), then runs n children of it. Child 0
starts first; once its first token is out, its prompt's full blocks are in the prefix cache, and children
1..n-1 start and find them there (their ``cached_tokens`` say so) instead of computing the prompt again.
A request with a seed gives child i the seed + i (vLLM's rule): the n answers are reproducible, and
differ. Whole: one response with n choices, usage counting the prompt once and every choice's tokens.
Streamed: every chunk carries its choice's index, in the order tokens come; each choice's finish, then
usage, then ``[DONE]``. Any child failing fails the request (whole: its status; streamed: in-band), and
the others are cancelled, which aborts them in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Callable

import msgspec
from fastapi.responses import JSONResponse, Response, StreamingResponse

from strata.deployments.openai import request_metrics as metrics
from strata.deployments.openai.protocol import usage
from strata.deployments.openai.responses import (chat_chunk, chat_completion, completion, completion_chunk,
                                                 openai_finish_reason, sse, usage_chunk)
from strata.deployments.openai.responder import (GenerationFailed, Responder, StreamStatus, Timed, client_error,
                                          error_response)
from strata.deployments.openai.request_end import at_request_end
from strata.pipeline.contract.request import Request, TokenEvent
from strata.pipeline.contract.sampling_params import SEED_MAX, SEED_MIN
from strata.pipeline.frontend.answer import AnswerDeltas, AnswerFormat

log = logging.getLogger("strata.ingress")
MAX_N = 16
Start = Callable[[Request], AsyncIterator[list[TokenEvent]]]


def children(prepared: Request, n: int) -> list[Request]:
    """The n requests of one prompt: ids ``<id>``, ``<id>-1``, ...; seeds seed, seed + 1, ... (wrapping)."""
    out = [prepared]
    seed = prepared.params.seed
    for i in range(1, n):
        child_seed = None if seed is None else (seed - SEED_MIN + i) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN
        params = dataclasses.replace(prepared.params, seed=child_seed, stop=list(prepared.params.stop))
        out.append(msgspec.structs.replace(prepared, request_id=f"{prepared.request_id}-{i}", params=params))
    return out


def _per_prompt(req: Any, kids: list[Request]) -> int:
    """Choices per prompt: the request's n (all of them for a request that does not say)."""
    return getattr(req, "n", None) or len(kids)


def _roots(kids: list[Request], n: int) -> range:
    """The first child of each prompt (``kids`` holds each prompt's n children in a row)."""
    return range(0, len(kids), n)


def _prompt_tokens(kids: list[Request], n: int) -> int:
    """Usage counts each prompt once, however many answers it has."""
    return sum(kids[i].num_prompt_tokens for i in _roots(kids, n))


async def _children_batches(kids: list[Request], start: Start, endpoint: str, t0: float, deadline_s: float,
                            out: asyncio.Queue) -> None:
    """Feed (index, batch) from every child into ``out`` (None batch: that child ended); child 0 first,
    the others once its first batch (the prompt cached) came or it failed. Exceptions go in as values."""
    first_done = asyncio.Event()

    async def run(i: int) -> None:
        if i:
            await first_done.wait()
        timed = Timed(start(kids[i]), endpoint, t0, deadline_s)
        try:
            while True:
                batch = await timed.next()
                if i == 0:
                    first_done.set()
                await out.put((i, batch))
                if batch is None:
                    timed.done()
                    return
        except Exception as exc:  # reported to the consumer, which cancels the rest
            await out.put((i, exc))
        finally:
            first_done.set()
            await timed.close()

    await asyncio.gather(*(run(i) for i in range(len(kids))))


class ManyChoices:
    """Responses of n > 1 (``Ingress`` uses it next to the single-choice :class:`Responder`)."""

    def __init__(self, responder: Responder) -> None:
        self.responder = responder

    async def _consume(self, kids: list[Request], start: Start, endpoint: str, t0: float) -> AsyncIterator[tuple[int, list[TokenEvent]]]:
        queue: asyncio.Queue = asyncio.Queue()
        feeder = asyncio.create_task(_children_batches(kids, start, endpoint, t0, self.responder.deadline_s, queue))
        at_request_end(feeder.cancel)  # the choices stop generating when the HTTP request ends, however it ends
        live = len(kids)
        try:
            while live:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    live -= 1
                    continue
                yield i, item
        finally:
            feeder.cancel()
            try:
                await feeder
            except (asyncio.CancelledError, Exception):
                pass

    async def whole(self, req: Any, kids: list[Request], start: Start, chat: bool, t0: float,
                    answer: AnswerFormat | None = None) -> Response:
        endpoint = "chat" if chat else "completions"
        r = self.responder
        collected: list[list[TokenEvent]] = [[] for _ in kids]
        try:
            async for i, batch in self._consume(kids, start, endpoint, t0):
                collected[i].extend(batch)
            reasons = [openai_finish_reason(next((e.finish_reason for e in reversed(c) if e.finish_reason), None))
                       for c in collected]
            if any(reason is None for reason in reasons):
                raise GenerationFailed("the token stream ended before the request finished")
        except Exception as exc:
            log.warning("request %s failed: %r", kids[0].request_id, exc)
            return error_response(client_error(exc, r.retry_after_s), endpoint)
        metrics.requests().inc(tags={"endpoint": endpoint, "status": "200"})
        cached = sum(max((e.num_cached_tokens for e in collected[i]), default=0) for i in _roots(kids, _per_prompt(req, kids)))
        use = usage(_prompt_tokens(kids, _per_prompt(req, kids)), sum(len(c) for c in collected), cached)
        created, rid = int(time.time()), kids[0].request_id
        choices = []
        for i, (events, reason) in enumerate(zip(collected, reasons)):
            text = "".join(e.text_delta for e in events)
            one = chat_completion(rid, r.model_name, created, text, reason, use) if chat else \
                completion(rid, r.model_name, created, text, reason, use)
            choice = {**one["choices"][0], "index": i}
            if answer is not None:
                answer.read(choice)
            if req.requested_logprobs() is not None:
                choice["logprobs"] = r.chat_logprobs(events) if chat else r.completion_logprobs(events, 0)
            choices.append(choice)
        body = (chat_completion if chat else completion)(rid, r.model_name, created, "", None, use)
        body["choices"] = choices
        return JSONResponse(body)

    async def stream(self, req: Any, kids: list[Request], start: Start, chat: bool, t0: float,
                     answer: AnswerFormat | None = None) -> Response:
        status = StreamStatus("chat" if chat else "completions")
        at_request_end(status.count)
        return StreamingResponse(self._sse(req, kids, start, chat, t0, status, answer), media_type="text/event-stream")

    async def _sse(self, req: Any, kids: list[Request], start: Start, chat: bool, t0: float, status: StreamStatus,
                   answer: AnswerFormat | None) -> AsyncIterator[str]:
        r = self.responder
        model, rid, created = r.model_name, kids[0].request_id, int(time.time())
        endpoint = "chat" if chat else "completions"
        obj = "chat.completion.chunk" if chat else "text_completion"
        want_logprobs = req.requested_logprobs() is not None

        deltas = [answer.deltas() for _ in kids] if answer is not None else None
        texts = [""] * len(kids)

        def chunk(i: int, text: str, reason: str | None, ev: TokenEvent | None = None, offset: int = 0,
                  delta: dict[str, Any] | None = None) -> str:
            if delta is None:
                delta = {"content": text} if text or reason is None else {}
            body = chat_chunk(rid, model, created, delta, reason) if chat else \
                completion_chunk(rid, model, created, text, reason)
            body["choices"][0]["index"] = i
            if ev is not None and want_logprobs:
                body["choices"][0]["logprobs"] = r.chat_logprobs([ev]) if chat else r.completion_logprobs([ev], offset)
            return sse(body)

        total, offsets, cached = 0, [0] * len(kids), [0] * len(kids)
        try:
            if chat:
                for i in range(len(kids)):
                    role = chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None)
                    role["choices"][0]["index"] = i
                    yield sse(role)
            finished = 0
            async for i, batch in self._consume(kids, start, endpoint, t0):
                out = []
                for ev in batch:
                    total += 1
                    cached[i] = max(cached[i], ev.num_cached_tokens)
                    if deltas is not None:  # a chat answer read apart: the delta of what the text adds
                        texts[i] += ev.text_delta
                        delta = deltas[i].update(texts[i], final=ev.finished)
                        if delta is not None or (want_logprobs and ev.logprob is not None):
                            out.append(chunk(i, "", None, ev, offsets[i], delta or {}))
                    elif ev.text_delta or (want_logprobs and ev.logprob is not None):
                        out.append(chunk(i, ev.text_delta, None, ev, offsets[i]))
                        offsets[i] += len(ev.text_delta)
                    if ev.finished:
                        reason = openai_finish_reason(ev.finish_reason)
                        if reason is None:
                            raise GenerationFailed("the token stream ended before the request finished")
                        if reason == "stop" and deltas is not None and deltas[i].has_calls:
                            reason = "tool_calls"
                        out.append(chunk(i, "", reason))
                        finished += 1
                if out:
                    yield "".join(out)
            if finished < len(kids):
                raise GenerationFailed("the token stream ended before the request finished")
            tail = []
            if req.include_usage:
                hits = sum(cached[i] for i in _roots(kids, _per_prompt(req, kids)))
                tail.append(sse(usage_chunk(rid, model, created, obj, usage(_prompt_tokens(kids, _per_prompt(req, kids)), total, hits))))
            tail.append(sse("[DONE]"))
            status.status = "200"
            yield "".join(tail)
        except Exception as exc:  # headers are sent: report in-band
            status.status, lines = r.stream_failure(rid, exc)
            yield lines
        finally:
            status.count()

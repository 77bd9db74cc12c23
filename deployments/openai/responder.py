"""Token-event batches -> an OpenAI response, whole or streamed (SSE), with metrics and safe errors.

What a client sees when something fails: before the first byte, a JSON error with its status (429
with ``Retry-After`` when a stage is saturated, 500 otherwise); once a stream has started, one
in-band error event and ``data: [DONE]``. Messages never carry exception text from Ray or the
stages (actor ids, pids, addresses): an error event's own message, written for clients, or a
generic one; the details go to the server log under the request id.

A request that ends without completing (an ``error`` or ``abort`` event, its deadline, a token
stream that stops early) takes those same error paths, never a ``finish_reason``: a client only
ever sees OpenAI's finish reasons, and only on answers that are complete.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse

from strata.deployments.openai import request_metrics as metrics
from strata.deployments.openai.prompt_echo import echo_logprobs, joined, prompt_logprobs_of, vllm_prompt_logprobs
from strata.deployments.openai.protocol import APIError, usage
from strata.deployments.openai.request_end import at_request_end
from strata.deployments.openai.responses import (
    ContentChunks,
    chat_chunk,
    chat_completion,
    completion,
    completion_chunk,
    is_completed,
    openai_finish_reason,
    sse,
    usage_chunk,
)
from strata.pipeline.contract.request import Request, TokenEvent
from strata.pipeline.frontend.answer import AnswerDeltas, AnswerFormat
from strata.stages.pixel_budget import PixelBudgetTimeout

log = logging.getLogger("strata.ingress")
Decode = Callable[[list[int]], str]


def _asks_prompt_logprobs(req: Any) -> bool:
    """The client asked for vLLM's ``prompt_logprobs`` field (echo alone puts them in ``logprobs``)."""
    return (getattr(req, "model_extra", None) or {}).get("prompt_logprobs") is not None


class GenerationFailed(Exception):
    """A stage ended the request with an error event; ``str(self)`` is fit for the client."""


def client_error(exc: BaseException, retry_after_s: float) -> APIError:
    """The API error a client gets for a failure, without internals."""
    if isinstance(exc, APIError):
        return exc
    if type(exc).__name__ == "BackPressureError" or _is_busy(exc):  # a stage's queue or image budget is full
        return APIError(429, "the server is busy; retry shortly", type_="rate_limit_error", code="rate_limit_exceeded",
                        retry_after_s=retry_after_s)
    if isinstance(exc, GenerationFailed):
        return APIError(500, f"generation failed: {exc}", type_="server_error")
    return APIError(500, "generation failed: a serving stage failed; retry the request", type_="server_error")


def _is_busy(exc: BaseException) -> bool:
    """A Preprocess replica waited too long for decode budget (Ray re-raises a replica's exception as
    an instance of its class, with the original as ``cause``): the server is saturated, so a 429."""
    return isinstance(exc, PixelBudgetTimeout) or isinstance(getattr(exc, "cause", None), PixelBudgetTimeout)


def error_response(exc: APIError, endpoint: str) -> JSONResponse:
    metrics.requests().inc(tags={"endpoint": endpoint, "status": str(exc.status)})
    headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))} if exc.retry_after_s is not None else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _check(batch: list[TokenEvent]) -> list[TokenEvent]:
    """The batch, or GenerationFailed at an event that ends its request without completing it: an
    error event, and also ``abort`` (or a reason this version does not know), so no response or
    chunk ever carries a finish reason outside OpenAI's set and no cut-short answer looks complete."""
    for ev in batch:
        if ev.finish_reason is None or is_completed(ev.finish_reason):
            continue
        if ev.finish_reason == "error":
            raise GenerationFailed(ev.error or "the request could not be completed")
        log.warning("request %s ended with finish reason %r", ev.request_id, ev.finish_reason)
        raise GenerationFailed("the request was stopped before it finished; retry the request")
    return batch


class StreamStatus:
    """A stream's line in ``strata_requests_total``, counted exactly once: when its generator ends, or when
    its HTTP request ends, whichever comes first. A client that leaves between chunks leaves the generator
    suspended until the garbage collector closes it, seconds or minutes later; counting only in its
    ``finally`` put that 499 in whatever window a dashboard (or a test) was reading then."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.status = "499"  # until the last event is written: a stream that ends early was cancelled
        self._counted = False

    def count(self) -> None:
        if not self._counted:
            self._counted = True
            metrics.requests().inc(tags={"endpoint": self.endpoint, "status": self.status})


class Timed:
    """Event batches passed through, observing TTFT, inter-token gaps (a batch of k tokens after a gap
    g counts k gaps of g/k) and, at the end, the end-to-end latency."""

    def __init__(self, batches: AsyncIterator[list[TokenEvent]], endpoint: str, t0: float, deadline_s: float) -> None:
        self.batches, self.tags, self.t0, self.last = batches, {"endpoint": endpoint}, t0, None
        self.deadline = t0 + deadline_s if deadline_s > 0 else None

    async def next(self) -> list[TokenEvent] | None:
        """The next batch, None at the end; GenerationFailed past the request's deadline (a stage that
        stopped answering never leaves the client waiting forever)."""
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())
        try:
            batch = await asyncio.wait_for(self.batches.__anext__(), timeout)
        except StopAsyncIteration:
            return None
        except asyncio.TimeoutError as exc:
            raise GenerationFailed(f"the request did not finish within {self.deadline - self.t0:.0f} s") from exc
        now_t = time.perf_counter()
        tokens = sum(e.token_id >= 0 for e in batch)
        if tokens:
            metrics.generation_tokens().inc(float(tokens), tags=self.tags)
        if self.last is None:
            metrics.ttft().observe(now_t - self.t0, tags=self.tags)
        else:
            gap = (now_t - self.last) / len(batch)
            for _ in batch:
                metrics.itl().observe(gap, tags=self.tags)
        self.last = now_t
        return _check(batch)

    def done(self) -> None:
        metrics.e2e().observe(time.perf_counter() - self.t0, tags=self.tags)

    async def close(self) -> None:
        """Stop the event stream (its stages abort the request); once, however often it is called."""
        aclose, self.batches_closed = (None if getattr(self, "batches_closed", False) else
                                       getattr(self.batches, "aclose", None)), True
        if aclose is not None:
            await aclose()


class Responder:
    """Builds the response of one request from its event stream (``Ingress`` owns one per replica)."""

    def __init__(self, model_name: str, decode: Decode, retry_after_s: float, deadline_s: float) -> None:
        self.model_name = model_name
        self.decode = decode
        self.retry_after_s = retry_after_s
        self.deadline_s = deadline_s  # per request, from its arrival (0: none)

    # ------------------------------------------------------------ logprobs in OpenAI's two shapes
    def _token(self, token_id: int) -> str:
        return self.decode([token_id])

    def chat_logprobs(self, events: list[TokenEvent]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [
            {**entry(ev.token_id, ev.logprob), "top_logprobs": [entry(t, lp) for t, lp in ev.top_logprobs or []]}
            for ev in events if ev.logprob is not None
        ]}

    def completion_logprobs(self, events: list[TokenEvent], offset: int) -> dict[str, Any]:
        tokens, logprobs, tops, offsets = [], [], [], []
        for ev in events:
            if ev.logprob is None:
                continue
            text = self._token(ev.token_id)
            tokens.append(text)
            logprobs.append(ev.logprob)
            tops.append({self._token(t): lp for t, lp in ev.top_logprobs or []})
            offsets.append(offset)
            offset += len(ev.text_delta)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    # ------------------------------------------------------------ whole responses
    async def whole(self, req: Any, prepared: Request, events: AsyncIterator[list[TokenEvent]], chat: bool,
                    t0: float, answer: AnswerFormat | None = None) -> Response:
        """``answer``: how a chat answer is read (its reasoning apart, its tool calls)."""
        endpoint = "chat" if chat else "completions"
        timed = Timed(events, endpoint, t0, self.deadline_s)
        at_request_end(timed.close)  # a client gone mid-answer stops its generation in every stage
        collected: list[TokenEvent] = []
        try:
            while (batch := await timed.next()) is not None:
                collected.extend(batch)
            # every event was checked: the last reason is a completed one, or there is none at all
            last = next((ev.finish_reason for ev in reversed(collected) if ev.finish_reason), None)
            reason = openai_finish_reason(last)
            if reason is None:
                raise GenerationFailed("the token stream ended before the request finished")
            timed.done()
        except Exception as exc:  # the request cannot be completed: say so without internals
            log.warning("request %s failed: %r", prepared.request_id, exc)
            return error_response(client_error(exc, self.retry_after_s), endpoint)
        metrics.requests().inc(tags={"endpoint": endpoint, "status": "200"})
        cached = max((ev.num_cached_tokens for ev in collected), default=0)
        shown = collected if getattr(req, "generates", True) else []  # max_tokens 0: the echo alone
        text = "".join(ev.text_delta for ev in shown)
        use = usage(prepared.num_prompt_tokens, len(shown), cached)
        created = int(time.time())
        if chat:
            body = chat_completion(prepared.request_id, self.model_name, created, text, reason, use)
            if answer is not None:
                answer.read(body["choices"][0])
            if req.requested_logprobs() is not None:
                body["choices"][0]["logprobs"] = self.chat_logprobs(collected)
            if _asks_prompt_logprobs(req):  # vLLM puts a chat's at the top (built off the shared loop)
                body["prompt_logprobs"] = await asyncio.to_thread(self._vllm_prompt_logprobs, prepared, collected)
        else:
            echo = self._echo_text(req, prepared)
            body = completion(prepared.request_id, self.model_name, created, echo + text, reason, use)
            choice = body["choices"][0]
            if req.requested_logprobs() is not None:
                answer = self.completion_logprobs(shown, len(echo))
                # a prompt's logprobs are as long as the prompt: built off the loop the other streams share
                choice["logprobs"] = joined(await asyncio.to_thread(self._echo_logprobs, prepared, collected), answer) \
                    if getattr(req, "echo", False) else answer
            if _asks_prompt_logprobs(req):
                choice["prompt_logprobs"] = await asyncio.to_thread(self._vllm_prompt_logprobs, prepared, collected)
        return JSONResponse(body)

    # ------------------------------------------------------------ the prompt's own logprobs (``prompt_echo``)
    def _echo_text(self, req: Any, prepared: Request) -> str:
        """The prompt as echoed: the client's text, or its token ids decoded."""
        if not getattr(req, "echo", False):
            return ""
        given = req.prompt_input()
        return given["raw_prompt"] if "raw_prompt" in given else self.decode(prepared.prompt_token_ids)

    def _echo_logprobs(self, prepared: Request, events: list[TokenEvent]) -> dict[str, Any]:
        return echo_logprobs(prepared.prompt_token_ids, prompt_logprobs_of(events), self._token_list)

    def _vllm_prompt_logprobs(self, prepared: Request, events: list[TokenEvent]) -> list[Any]:
        return vllm_prompt_logprobs(prepared.prompt_token_ids, prompt_logprobs_of(events), self._token_list)

    def _token_list(self, ids: list[int]) -> str:
        return self.decode(ids)

    # ------------------------------------------------------------ streams
    async def stream(self, req: Any, prepared: Request, events: AsyncIterator[list[TokenEvent]], chat: bool,
                     t0: float, answer: AnswerFormat | None = None) -> Response:
        """The first batch is awaited before any byte is sent, so a request refused by a stage (busy,
        failed) still gets its status and JSON error; later failures are reported in-band."""
        endpoint = "chat" if chat else "completions"
        timed = Timed(events, endpoint, t0, self.deadline_s)
        # the stream's generator may never run its finally (a client gone between chunks leaves it suspended,
        # for the garbage collector): its generation is stopped when the HTTP request ends
        at_request_end(timed.close)
        try:
            first = await timed.next()
        except Exception as exc:
            await timed.close()
            log.warning("request %s failed before its first token: %r", prepared.request_id, exc)
            return error_response(client_error(exc, self.retry_after_s), endpoint)
        deltas = answer.deltas() if answer is not None else None
        status = StreamStatus(endpoint)
        at_request_end(status.count)
        return StreamingResponse(self._sse(req, prepared, timed, first, chat, status, deltas),
                                 media_type="text/event-stream")

    async def _sse(self, req: Any, prepared: Request, timed: Timed, first: list[TokenEvent] | None,
                   chat: bool, status: StreamStatus, answer_deltas: AnswerDeltas | None = None) -> AsyncIterator[str]:
        model, rid, created = self.model_name, prepared.request_id, int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        want_logprobs = req.requested_logprobs() is not None
        content = ContentChunks(rid, model, created, chat)
        n, cached, reason, offset, text = 0, 0, None, 0, ""
        shows = getattr(req, "generates", True)  # max_tokens 0: the echo alone
        try:
            if chat:
                role = chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None)
                if _asks_prompt_logprobs(req):
                    role["prompt_logprobs"] = await asyncio.to_thread(self._vllm_prompt_logprobs, prepared, first or [])
                yield sse(role)
            elif getattr(req, "echo", False) or _asks_prompt_logprobs(req):  # the prompt's chunk first
                echo = self._echo_text(req, prepared)
                chunk = completion_chunk(rid, model, created, echo, None)
                if getattr(req, "echo", False) and want_logprobs:
                    chunk["choices"][0]["logprobs"] = await asyncio.to_thread(
                        self._echo_logprobs, prepared, first or [])
                if _asks_prompt_logprobs(req):
                    chunk["choices"][0]["prompt_logprobs"] = await asyncio.to_thread(
                        self._vllm_prompt_logprobs, prepared, first or [])
                yield sse(chunk)
                offset = len(echo)
            batch = first
            while batch is not None:
                out = []  # one chunk per token, one write per batch
                for ev in batch:
                    cached = max(cached, ev.num_cached_tokens)
                    if ev.finished:
                        reason = openai_finish_reason(ev.finish_reason)
                    if not shows:
                        continue
                    n += 1
                    if answer_deltas is not None:
                        text += ev.text_delta
                    elif want_logprobs:
                        out.append(sse(self._logprob_chunk(rid, model, created, chat, ev, offset)))
                    elif ev.text_delta:
                        out.append(content(ev.text_delta))
                    offset += len(ev.text_delta)
                if answer_deltas is not None:  # a chat answer read apart: one chunk per batch
                    out.extend(self._answer_chunk(rid, model, created, answer_deltas, text, reason, batch,
                                                  want_logprobs))
                    if reason == "stop" and answer_deltas.has_calls:
                        reason = "tool_calls"
                if reason is not None:
                    out.append(sse(chat_chunk(rid, model, created, {}, reason) if chat
                                   else completion_chunk(rid, model, created, "", reason)))
                    if req.include_usage:
                        out.append(sse(usage_chunk(rid, model, created, obj, usage(prepared.num_prompt_tokens, n, cached))))
                    out.append(sse("[DONE]"))
                    status.status = "200"  # complete as far as the client is concerned, whatever happens next
                    timed.done()
                if out:
                    yield "".join(out)
                if reason is not None:
                    return
                batch = await timed.next()
            raise GenerationFailed("the token stream ended before the request finished")
        except Exception as exc:  # headers are sent: report in-band, as OpenAI-compatible servers do
            status.status, lines = self.stream_failure(rid, exc)
            yield lines
        finally:
            status.count()
            await timed.close()

    def stream_failure(self, rid: str, exc: BaseException) -> tuple[str, str]:
        """A started stream's failure: its status (for the metrics) and the in-band error event + [DONE]."""
        log.warning("stream %s failed: %r", rid, exc)
        error = client_error(exc, self.retry_after_s)
        return str(error.status), sse(error.body()) + sse("[DONE]")

    def _answer_chunk(self, rid: str, model: str, created: int, deltas: AnswerDeltas, text: str, reason: str | None,
                      batch: list[TokenEvent], want_logprobs: bool) -> list[str]:
        """The chunk of what ``text`` adds (reasoning, content and/or tool-call deltas), with the batch's logprobs."""
        delta = deltas.update(text, final=reason is not None)
        if delta is None and not want_logprobs:
            return []
        chunk = chat_chunk(rid, model, created, delta or {}, None)
        if want_logprobs:
            chunk["choices"][0]["logprobs"] = self.chat_logprobs(batch)
        return [sse(chunk)]

    def _logprob_chunk(self, rid: str, model: str, created: int, chat: bool, ev: TokenEvent, offset: int) -> dict:
        if chat:
            chunk = chat_chunk(rid, model, created, {"content": ev.text_delta}, None)
            chunk["choices"][0]["logprobs"] = self.chat_logprobs([ev])
        else:
            chunk = completion_chunk(rid, model, created, ev.text_delta, None)
            chunk["choices"][0]["logprobs"] = self.completion_logprobs([ev], offset)
        return chunk

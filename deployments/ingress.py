"""The HTTP front door: an OpenAI-compatible FastAPI app served by Ray Serve.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health`` and ``GET /strata/stats`` (per-stage KV and queue figures, for operators and
tests). Validation failures are OpenAI-style error bodies with a 4xx status; streaming uses
server-sent events ending with ``data: [DONE]``.

In the aggregated mode this deployment (named ``LLM``) also runs the engine: prefill and decode in
one step loop over one KV pool, so the replica that generates a token is the one that writes it to
the HTTP stream. The model loads on a background thread; until it has, and in the disaggregated
mode until every stage answers, ``/health`` is a 503 saying what it waits for.
"""


import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from strata.deployments import metrics
from strata.deployments.config import ServeConfig
from strata.deployments.openai_protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, new_id, now, parse_request, split_chat, usage,
)
from strata.deployments.openai_responses import (
    ContentChunks, chat_chunk, chat_completion, completion, completion_chunk, openai_finish_reason, sse, usage_chunk,
)
from strata.deployments.request_flow import LocalFlow, RequestFlow, StageFlow
from strata.pipeline.intake import Intake
from strata.pipeline.model_config import load_llava_config
from strata.pipeline.request import Request, TokenEvent
from strata.pipeline.tokenizer import PromptTokenizer

log = logging.getLogger("strata.ingress")
app = FastAPI(title="Strata", description="OpenAI-compatible vision-language model serving")


def _error(exc: APIError, endpoint: str) -> JSONResponse:
    metrics.requests().inc(tags={"endpoint": endpoint, "status": str(exc.status)})
    return JSONResponse(exc.body(), status_code=exc.status)


async def _json_body(request: HTTPRequest) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from exc


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, preprocess: Any, encode: Any, prefill: Any, decode: Any, config: dict[str, Any]) -> None:
        """``prefill``/``decode`` are the stage handles (disaggregated mode), or None: this replica runs
        the engine itself (aggregated mode)."""
        self.config = ServeConfig.from_dict(config)
        model_dir = Path(self.config.model_dir or "")
        self.model_name = self.config.model_name or model_dir.name
        self.tokenizer = PromptTokenizer(model_dir, load_llava_config(model_dir))
        intake = Intake(self.tokenizer, self.config.engine)
        self.ongoing = 0
        self._deltas = metrics.CounterDelta()
        self.service: Any = None
        self._load_error: str | None = None
        self._loaded = threading.Event()
        self._all_ready = False
        if prefill is None:
            self.stage_handles = {"encode": encode}
            self.flow: RequestFlow = LocalFlow(intake, preprocess, encode, None)
            threading.Thread(target=self._load_engine, args=(model_dir,), name="engine-load", daemon=True).start()
        else:
            self.stage_handles = {"prefill": prefill, "decode": decode, "encode": encode}
            self.flow = StageFlow(intake, preprocess, encode, prefill, decode)
            self._loaded.set()
        self.readiness_handles = {"preprocess": preprocess, **self.stage_handles}

    def _load_engine(self, model_dir: Path) -> None:
        from strata.stages.engine_service import EngineService
        from strata.stages.factory import build_engine

        try:
            engine = build_engine(model_dir, self.config.engine)
            self.service = EngineService(engine, self.config.stream_interval_ms / 1000)
            self.flow.service = self.service  # type: ignore[attr-defined]
        except Exception as exc:  # reported by /health and to every request; never a hang
            log.exception("loading the model failed")
            self._load_error = f"{type(exc).__name__}: {exc}"
        finally:
            self._loaded.set()

    async def _engine_ready(self) -> None:
        """Wait (bounded) for a model still loading; a request never waits forever."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        while not self._loaded.is_set():
            if time.monotonic() > deadline:
                raise APIError(503, "the model is still loading; retry shortly", type_="server_error")
            await asyncio.sleep(0.05)
        if self._load_error is not None:
            raise APIError(503, "the model failed to load on this replica", type_="server_error")

    # ------------------------------------------------------------ small routes
    @app.get("/health")
    async def health(self) -> Response:
        """200 once this replica and every stage it calls can serve; 503 with what it waits for."""
        if not self._loaded.is_set():
            return JSONResponse({"status": "starting", "waiting_for": ["model"]}, status_code=503)
        if self._load_error is not None:
            return JSONResponse({"status": "failed", "reason": "the model failed to load"}, status_code=503)
        if not self._all_ready:
            waiting = []
            for name, handle in self.readiness_handles.items():
                try:
                    await asyncio.wait_for(handle.ready.remote(), timeout=2.0)
                except Exception:  # not up yet (or gone): say which, never hang
                    waiting.append(name)
            if waiting:
                return JSONResponse({"status": "starting", "waiting_for": waiting}, status_code=503)
            self._all_ready = True
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "strata",
             "max_model_len": self.config.engine.max_model_len}
        ]}

    @app.get("/strata/stats")
    async def stats(self) -> dict[str, Any]:
        out = {name: await handle.stats.remote() for name, handle in self.stage_handles.items()}
        if self.service is not None:  # aggregated: prefill and decode are this replica's engine
            engine = await self.service.stats()
            out["prefill"] = out["decode"] = engine
        out["ingress"] = {"ongoing_requests": self.ongoing, "mode": self.config.mode}
        return out

    async def record_autoscaling_stats(self) -> dict[str, float]:
        signals = {"ongoing_requests": float(self.ongoing)}
        if self.service is not None:
            stats = await self.service.stats()
            metrics.queue_depth().set(float(stats["running"]), tags={"stage": "llm"})
            metrics.record_kv("llm", stats, self._deltas)
            signals.update(running_sequences=float(stats["running"]), kv_occupancy=float(stats["kv_occupancy"]))
        return signals

    # ------------------------------------------------------------ completions
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: HTTPRequest) -> Response:
        t0, rid = time.perf_counter(), new_id("chatcmpl")
        try:
            req = parse_request(ChatCompletionRequest, await _json_body(request))
            self._check_model(req.model)
            messages, images = split_chat(req.messages, self.config.max_image_bytes)
            params = req.sampling_params(default_max_tokens=1)
            await self._engine_ready()
            prepared = await self.flow.prepare(rid, params, req.max_tokens is None, images, messages=messages)
        except APIError as exc:
            return _error(exc, "chat")
        return await self._respond(req, prepared, chat=True, t0=t0)

    @app.post("/v1/completions")
    async def completions(self, request: HTTPRequest) -> Response:
        t0, rid = time.perf_counter(), new_id("cmpl")
        try:
            req = parse_request(CompletionRequest, await _json_body(request))
            self._check_model(req.model)
            params = req.sampling_params(default_max_tokens=1)
            await self._engine_ready()
            prepared = await self.flow.prepare(rid, params, req.max_tokens is None, [], raw_prompt=req.prompt_text())
        except APIError as exc:
            return _error(exc, "completions")
        return await self._respond(req, prepared, chat=False, t0=t0)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves `{self.model_name}`)",
                           code="model_not_found", param="model")

    async def _respond(self, req: Any, prepared: Request, chat: bool, t0: float) -> Response:
        rid, created = prepared.request_id, now()
        endpoint = "chat" if chat else "completions"
        if req.stream:
            return StreamingResponse(self._stream(req, prepared, chat, created, t0), media_type="text/event-stream")
        self.ongoing += 1
        try:
            text, reason, n, cached = "", None, 0, 0
            async for batch in self._timed(self.flow.events(prepared), endpoint, t0):
                for ev in batch:
                    n += 1
                    text += ev.text_delta
                    cached = max(cached, ev.num_cached_tokens)
                    reason = ev.finish_reason or reason
        except Exception as exc:  # a stage failed: the request cannot be completed
            log.exception("request %s failed", rid)
            return _error(APIError(500, f"generation failed: {exc}", type_="server_error"), endpoint)
        finally:
            self.ongoing -= 1
        metrics.requests().inc(tags={"endpoint": endpoint, "status": "200"})
        use = usage(prepared.num_prompt_tokens, n, cached)
        build = chat_completion if chat else completion
        return JSONResponse(build(rid, self.model_name, created, text, openai_finish_reason(reason), use))

    @staticmethod
    async def _timed(batches: AsyncIterator[list[TokenEvent]], endpoint: str,
                     t0: float) -> AsyncIterator[list[TokenEvent]]:
        """Pass event batches through, observing TTFT, inter-token gaps (a batch of k tokens after a
        gap g counts k gaps of g/k) and, at the end, E2E latency."""
        tags = {"endpoint": endpoint}
        last = None
        async for batch in batches:
            now_t = time.perf_counter()
            if last is None:
                metrics.ttft().observe(now_t - t0, tags=tags)
            else:
                for _ in batch:
                    metrics.itl().observe((now_t - last) / len(batch), tags=tags)
            last = now_t
            yield batch
        metrics.e2e().observe(time.perf_counter() - t0, tags=tags)

    async def _stream(self, req: Any, prepared: Request, chat: bool, created: int, t0: float) -> AsyncIterator[str]:
        model, rid = self.model_name, prepared.request_id
        endpoint = "chat" if chat else "completions"
        self.ongoing += 1
        status = "499"  # until it completes: a stream that ends early was cancelled by the client
        try:
            if chat:
                yield sse(chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None))
            content = ContentChunks(rid, model, created, chat)
            n, cached, reason = 0, 0, None
            async for batch in self._timed(self.flow.events(prepared), endpoint, t0):
                out = []  # one chunk per token, one write per batch: fewer hops through the proxy
                for ev in batch:
                    n += 1
                    cached = max(cached, ev.num_cached_tokens)
                    if ev.finished:
                        reason = openai_finish_reason(ev.finish_reason)
                    if ev.text_delta:
                        out.append(content(ev.text_delta))
                if reason is not None:
                    out.append(sse(chat_chunk(rid, model, created, {}, reason) if chat
                                   else completion_chunk(rid, model, created, "", reason)))
                    if req.include_usage:
                        obj = "chat.completion.chunk" if chat else "text_completion"
                        out.append(sse(usage_chunk(rid, model, created, obj, usage(prepared.num_prompt_tokens, n, cached))))
                    out.append(sse("[DONE]"))
                if out:
                    yield "".join(out)
            if reason is None:  # the stages ended the stream without a finish event
                raise RuntimeError("the token stream ended before the request finished")
            status = "200"
        except Exception as exc:  # headers are sent: report in-band, as OpenAI-compatible servers do
            log.exception("stream %s failed", rid)
            status = "500"
            yield sse(APIError(500, f"generation failed: {exc}", type_="server_error").body())
            yield sse("[DONE]")
        finally:
            self.ongoing -= 1
            metrics.requests().inc(tags={"endpoint": endpoint, "status": status})

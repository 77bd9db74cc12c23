"""The HTTP front door: an OpenAI-compatible FastAPI app served by Ray Serve.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and ``/v1/models/{id}``),
``GET /health`` and ``GET /strata/stats`` (per-stage KV and queue figures, for operators and
tests); vLLM's ``/ping``, ``/version``, ``/metrics``, ``POST /tokenize`` and ``POST /detokenize``
(``deployments.ray_serve.token_routes``). With ``--api-key`` every route but ``/health``, ``/ping``, ``/version``
and ``/metrics`` needs the Bearer token. Validation failures are OpenAI-style error bodies with a 4xx status;
streaming uses server-sent events ending with ``data: [DONE]``.

In the aggregated mode this deployment (named ``LLM``) also runs the engine: prefill and decode in
one step loop over one KV pool, so the replica that generates a token is the one that writes it to
the HTTP stream. The model loads on a background thread; until it has, and in the disaggregated
mode until every stage answers, ``/health`` is a 503 saying what it waits for.
"""


import asyncio
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve

from strata.deployments.ray_serve import metrics
from strata.deployments.openai.admission import Admission
from strata.deployments.openai.api_key import CHALLENGE, DIGEST_ENV, UNAUTHORIZED, authorized
from strata.deployments.ray_serve.config import ServeConfig
from strata.deployments.openai.http_input import off_loop, read_json
from strata.deployments.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_prompt_size,
    new_id,
    parse_request,
    split_chat,
)
from strata.deployments.openai.request_flow import LocalFlow, RequestFlow, StageFlow
from strata.deployments.openai.parallel_sampling import ManyChoices, children
from strata.deployments.openai.request_end import RequestEndMiddleware
from strata.deployments.openai.responder import Responder, client_error, error_response
from strata.deployments.ray_serve.token_routes import (DetokenizeRequest, TokenizeRequest, detokenize, node_metrics,
                                             server_version, tokenize, tokenizer_info)
from strata.deployments.openai.responses_request import ResponsesRequest
from strata.deployments.openai.responses_route import responses_answer
from strata.deployments.ray_serve.vllm_metrics import vllm_metrics
from strata.pipeline.frontend.answer import AnswerFormat
from strata.pipeline.frontend.generation_defaults import load_generation_defaults
from strata.pipeline.frontend.intake import Intake
from strata.pipeline.frontend.reasoning import reasoning_format_for
from strata.pipeline.frontend.tokenizer import PromptTokenizer
from strata.pipeline.frontend.tools.calls import constrain
from strata.pipeline.frontend.tools.formats import tool_format_for
from strata.pipeline.models.model_config import load_model_config
from strata.stages.image_preprocessing import image_preprocessor
from strata.stages.kv_budget import kv_dtype, kv_layout
from strata.stages.engine_process import EngineProcessError
from strata.stages.stage_loop import LoopStopped

log = logging.getLogger("strata.ingress")
app = FastAPI(title="Strata", description="OpenAI-compatible vision-language model serving")
app.add_middleware(RequestEndMiddleware)  # a request's end-of-request work (its admission slot, its stream's close)


@app.middleware("http")
async def _require_api_key(request: HTTPRequest, call_next: Any) -> Response:
    """``--api-key``: every route but the probes (/health, /ping, /version, /metrics) needs the Bearer token (``deployments.openai.api_key``). The digest is
    read from this replica's environment, where ``Ingress.__init__`` puts it: Serve ships this app to the
    replica by value, so a module global set there would be another copy than the one this function sees."""
    if not authorized(request.url.path, request.headers.get("authorization"), os.environ.get(DIGEST_ENV)):
        return JSONResponse(UNAUTHORIZED, status_code=401, headers=CHALLENGE)
    return await call_next(request)


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(self, preprocess: Any, encode: Any, prefill: Any, decode: Any, config: dict[str, Any]) -> None:
        """``prefill``/``decode`` are the stage handles (disaggregated mode), or None: this replica runs
        the engine itself (aggregated mode)."""
        self.config = ServeConfig.from_dict(config)
        if self.config.api_key_sha256:
            os.environ[DIGEST_ENV] = self.config.api_key_sha256
        else:
            os.environ.pop(DIGEST_ENV, None)
        model_dir = Path(self.config.model_dir or "")
        self.model_name = self.config.model_name or model_dir.name
        self.tokenizer = PromptTokenizer(model_dir, load_model_config(model_dir), self.config.chat_template)
        self.tool_format = tool_format_for(self.config.tool_call_parser, self.tokenizer.tokenizer)
        self.reasoning_format = reasoning_format_for(self.config.reasoning_parser, self.tokenizer.tokenizer)
        self.generation = load_generation_defaults(self.config.generation_config, model_dir)
        intake = Intake(self.tokenizer, self.config.engine, self.generation.max_tokens)
        model_config = load_model_config(model_dir)
        # an image whose token count depends on it is counted here, from its header, before it is sent anywhere
        counter = image_preprocessor(model_dir, model_config, max_pixels=self.config.engine.max_image_pixels) \
            if model_config.image_tokens_vary else None
        threading.Thread(target=intake.warm_grammars, name="grammar-sandbox-start", daemon=True).start()
        stage = self.config.stages["llm" if prefill is None else "ingress"]
        self.admission = Admission(stage.max_ongoing_requests + stage.max_queued_requests)
        self.retry_after_s = stage.retry_after_s
        self.responder = Responder(self.model_name, self.tokenizer.decode, self.retry_after_s,
                                   self.config.engine.request_timeout_s)
        self._deltas = metrics.CounterDelta()
        self.service: Any = None
        self._load_error: str | None = None
        self._loaded = threading.Event()
        self._all_ready = False
        if prefill is None:
            self.stage_handles = {"encode": encode} if encode is not None else {}
            self.flow: RequestFlow = LocalFlow(intake, preprocess, encode, None, counter)
            threading.Thread(target=self._load_engine, args=(model_dir,), name="engine-load", daemon=True).start()
        else:
            self.stage_handles = {"prefill": prefill, "decode": decode}
            if encode is not None:
                self.stage_handles["encode"] = encode
            block_bytes = kv_layout(model_config.text, self.config.engine.block_size,
                                    kv_dtype(self.config.engine)).bytes_per_block()
            self.flow = StageFlow(intake, preprocess, encode, prefill, decode, counter, block_bytes)
            self._loaded.set()
        self.readiness_handles = {**({"preprocess": preprocess} if preprocess is not None else {}), **self.stage_handles}

    def _load_engine(self, model_dir: Path) -> None:
        """The engine core in a child process (``engine_process``, tp 1), or stepped on a thread of this one
        (a tensor-parallel group's workers are Ray actors this replica owns)."""
        from strata.deployments.ray_serve.tp_actors import RayWorkers, group_host
        from strata.stages.engine_process import EngineProcess
        from strata.stages.engine_service import EngineService
        from strata.stages.factory import build_engine

        interval = self.config.stream_interval_ms / 1000
        try:
            engine_config = self.config.engine.model_copy(update={"tp": self.config.tp("llm")})
            if self.config.engine_process and engine_config.tp == 1:
                self.service = EngineProcess(str(model_dir), engine_config.to_dict(), interval,
                                             self.config.startup_timeout_s)
            else:
                engine = build_engine(model_dir, engine_config, RayWorkers, group_host())
                if engine.core.grammar is not None:
                    engine.core.grammar.warm()  # the vocabulary's trie, before any stream could wait on it
                self.service = EngineService(engine, interval)
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

    def check_health(self) -> None:
        """Serve replaces an LLM replica whose engine process or tensor-parallel worker died."""
        if self.service is not None and not self.service.healthy():
            raise RuntimeError("the engine of this replica stopped")

    def __del__(self) -> None:
        if getattr(self, "service", None) is not None:  # the aggregated LLM: stop its loop (and tp workers)
            self.service.close()

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

    @app.get("/ping")
    async def ping(self) -> Response:
        """vLLM's liveness route: /health's status, no body to parse."""
        return Response(status_code=(await self.health()).status_code)

    @app.get("/version")
    async def version(self) -> dict[str, str]:
        return server_version()

    @app.get("/metrics")
    async def metrics_text(self) -> Response:
        try:
            text = await node_metrics()
        except APIError as exc:
            return error_response(exc, "metrics")
        try:  # vLLM's names beside Strata's, for dashboards built for vLLM (``vllm_metrics``)
            text += await asyncio.to_thread(vllm_metrics, text, self.model_name)
        except ValueError:  # the node's text did not parse: Strata's own metrics still go out
            log.warning("the node's metrics text did not parse: /metrics carries no vllm: names this time")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize_route(self, request: HTTPRequest) -> Response:
        return await self._token_route(request, TokenizeRequest, lambda r: tokenize(
            r, self.tokenizer, self.config.engine.max_model_len, self.config.max_image_bytes))

    @app.post("/detokenize")
    async def detokenize_route(self, request: HTTPRequest) -> Response:
        return await self._token_route(request, DetokenizeRequest,
                                       lambda r: detokenize(r, self.tokenizer, self.config.engine.max_model_len))

    async def _token_route(self, request: HTTPRequest, model: type, run: Any) -> Response:
        try:
            body = await read_json(request, self.config.max_request_bytes, self.config.request_body_timeout_s)
            req = await off_loop(request, parse_request, model, body)
            if req.model is not None:
                self._check_model(req.model)
            async with self.flow.tokenizing:  # the completions' two slots: a flood of these cannot pile up work
                return JSONResponse(await asyncio.to_thread(run, req))
        except APIError as exc:
            return error_response(exc, "tokenize")

    @app.get("/tokenizer_info")
    async def tokenizer_info_route(self) -> Response:
        """vLLM's route, served when ``enable_tokenizer_info_endpoint`` is on (a 404 otherwise, as vLLM's)."""
        if not self.config.enable_tokenizer_info_endpoint:
            exc = APIError(404, "/tokenizer_info is off: start the server with --enable-tokenizer-info-endpoint",
                           code="not_found")
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse(await asyncio.to_thread(tokenizer_info, self.tokenizer))

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> Response:
        """One model's card (the openai client's ``models.retrieve``); another id is a 404."""
        try:
            self._check_model(model_id)
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "strata",
                "max_model_len": self.config.engine.max_model_len}

    @app.get("/strata/stats")
    async def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, handle in self.stage_handles.items():
            try:  # a stage that is saturated or being replaced is reported, not a failed page
                out[name] = await asyncio.wait_for(handle.stats.remote(), timeout=10.0)
            except Exception as exc:
                out[name] = {"unavailable": type(exc).__name__}
        if self.service is not None:  # aggregated: prefill and decode are this replica's engine
            try:
                engine = await self.service.stats()
            except (LoopStopped, EngineProcessError) as exc:  # being replaced: reported, not a failed page
                engine = {"unavailable": type(exc).__name__}
            out["prefill"] = out["decode"] = engine
        out["ingress"] = {"ongoing_requests": self.admission.held, "mode": self.config.mode,
                          "grammars": self.flow.intake.grammar_stats(), "flows": self.flow.traces.recent()}
        return out

    async def record_autoscaling_stats(self) -> dict[str, float]:
        signals = {"ongoing_requests": float(self.admission.held)}
        if self.service is not None:
            try:
                stats = await self.service.stats()
            except (LoopStopped, EngineProcessError):  # shutting down, or the engine is gone (being replaced)
                return signals
            metrics.queue_depth().set(float(stats["running"]), tags={"stage": "llm"})
            metrics.record_kv("llm", stats, self._deltas)
            signals.update(running_sequences=float(stats["running"]), kv_occupancy=float(stats["kv_occupancy"]))
        return signals

    # ------------------------------------------------------------ completions
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: HTTPRequest) -> Response:
        return await self._complete(request, chat=False)

    @app.post("/v1/responses")
    async def responses(self, request: HTTPRequest) -> Response:
        """The OpenAI Responses API, run as the chat request it translates to (``openai.responses_route``)."""
        try:
            body = await read_json(request, self.config.max_request_bytes, self.config.request_body_timeout_s,
                                   lambda b: check_prompt_size(b, self.config.engine.max_model_len))
            req = await off_loop(request, parse_request, ResponsesRequest, body)
            chat_body = req.chat_body()
        except APIError as exc:
            return error_response(exc, "responses")
        chat = await self._complete(request, chat=True, body=chat_body)
        return await responses_answer(chat, req)

    async def _complete(self, request: HTTPRequest, chat: bool, body: Any = None) -> Response:
        """``body``: already read and decoded (a translated Responses request); else read from ``request``."""
        t0, rid = time.perf_counter(), new_id("chatcmpl" if chat else "cmpl")
        endpoint = "chat" if chat else "completions"
        if body is None:
            try:  # the body first, under its own deadline: a stalled upload is never counted as admitted work
                body = await read_json(request, self.config.max_request_bytes, self.config.request_body_timeout_s,
                                       lambda b: check_prompt_size(b, self.config.engine.max_model_len))
            except APIError as exc:
                return error_response(exc, endpoint)
        if not self.admission.admit():  # a slot until this request ends, however it ends
            return error_response(APIError(429, "the server is busy; retry shortly", type_="rate_limit_error",
                                           code="rate_limit_exceeded", retry_after_s=self.retry_after_s), endpoint)
        try:
            req = await off_loop(request, parse_request, ChatCompletionRequest if chat else CompletionRequest, body)
            self._check_model(req.model)
            params = req.sampling_params(self.generation)
            tools = req.tool_request() if chat else None
            reads_calls = tools is not None and tools.parses_calls
            reasoning = self.reasoning_format if chat else None  # a chat answer's thinking is read apart
            if getattr(reasoning, "needs_special_tokens", False):  # harmony's markers are special tokens
                params.skip_special_tokens = False
            if reads_calls:
                try:
                    constrain(params, tools, self.tool_format)
                except ValueError as exc:
                    raise APIError(400, str(exc), param="tools") from None
            await self._engine_ready()
            if chat:
                messages, images = await off_loop(request, split_chat, req.messages, self.config.max_image_bytes)
                prepared = await self.flow.prepare(rid, params, images, messages=messages,
                                                   mm_processor_kwargs=req.mm_processor_kwargs,
                                                   template_kwargs=req.chat_template_kwargs,
                                                   tools=tools.template_tools() if tools is not None else None)
                if reasoning is not None and params.structured is not None and not reads_calls:
                    self._constrain_after_thinking(params, reasoning, prepared.prompt_token_ids)
            else:  # several prompts: one request each, ``<id>``, ``<id>-p1``, ...
                prompts = [await self.flow.prepare(rid if i == 0 else f"{rid}-p{i}", params, [], **one)
                           for i, one in enumerate(req.prompt_inputs())]
                prepared = prompts[0]
        except Exception as exc:  # APIError: the client's to fix; anything else: ours, without internals
            if not isinstance(exc, APIError):
                log.exception("request %s: intake failed", rid)
            return error_response(client_error(exc, self.retry_after_s), endpoint)
        # a chat answer is read for its reasoning (where the model writes some) and tool calls (where the request
        # has tools); a completion is the text as written
        calls = self.tool_format.for_request(tools) if reads_calls else None
        answer = AnswerFormat(reasoning, calls) if reasoning is not None or calls is not None else None
        roots = [prepared] if chat else prompts
        if req.n > 1 or len(roots) > 1:  # n answers of each prompt, its KV computed once (``parallel_sampling``)
            kids = [kid for root in roots for kid in children(root, req.n)]
            many = ManyChoices(self.responder)
            if req.stream:
                return await many.stream(req, kids, self.flow.events, chat, t0, answer)
            return await many.whole(req, kids, self.flow.events, chat, t0, answer)
        events = self.flow.events(prepared)
        if req.stream:
            return await self.responder.stream(req, prepared, events, chat, t0, answer)
        return await self.responder.whole(req, prepared, events, chat, t0, answer)

    def _constrain_after_thinking(self, params: Any, reasoning: Any, prompt_ids: list[int]) -> None:
        """A response format applies to the answer: its grammar starts after the thinking's end tag, while the
        prompt leaves the thinking to come (``ReasoningFormat.answer_trigger``)."""
        trigger = reasoning.answer_trigger(prompt_ids, self.tokenizer.tokenizer)
        if trigger is not None and trigger < self.tokenizer.vocab_size:
            params.structured_trigger, params.structured_trigger_in_grammar = trigger, False

    def _check_model(self, model: str) -> None:
        if model != self.model_name and model not in self.config.model_aliases:
            raise APIError(404, f"The model `{model}` does not exist (this server serves `{self.model_name}`)",
                           code="model_not_found", param="model")

"""In-process engine: preprocess, encode, then prefill and decode in one step loop over one KV pool.

Prefill chunks and decode tokens of one step run in one forward (the scheduler mixes them under one
token budget, decodes first), so the weights are read once per step and one scheduler decides every
preemption. The disaggregated stages (``stages/``) keep their own single-purpose loops. Used by
`strata generate`, the numerics tests and the aggregated serving mode.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.errors import RequestFailed
from strata.pipeline.contract.request import PromptLogprob, Request, TokenEvent
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.engine_core import EngineCore
from strata.pipeline.core.sequence import Sequence
from strata.pipeline.core.stage_api import EncoderLike, PreprocessorLike
from strata.pipeline.frontend.intake import Intake, attach_images
from strata.pipeline.frontend.tokenizer import NO_IMAGES, PromptTokenizer
from strata.pipeline.models.model_config import ModelConfig

RECENT_STEPS = 1024  # steps kept in ``Engine.recent_steps`` (~25 KiB in a stats reply)


@dataclass
class RequestOutput:
    """The final result of one request (``Engine.generate``)."""

    request_id: str
    output_token_ids: list[int]
    text: str
    finish_reason: str | None  # eos/stop, length, abort, or error (then ``error`` says why)
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None
    prompt_logprobs: list[PromptLogprob] | None = None  # when asked for: prompt tokens 1.. given those before


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: PromptTokenizer,
        preprocessor: PreprocessorLike | None,
        encoder: EncoderLike | None,
        core: EngineCore,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.intake = Intake(tokenizer, config)
        self.preprocessor = preprocessor
        self.encoder = encoder
        self.core = core
        self.scheduler = core.scheduler
        self.kv = core.scheduler.kv
        # New prompts leave one free block per decoding sequence, so the next step's decodes find room
        # without preempting the prompt that was just admitted.
        self.scheduler.admission_watermark = lambda: self.num_running
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.last_step_tokens = 0
        self.step_totals = {"steps": 0, "seconds": 0.0, "tokens": 0}  # where a served token's time goes
        # (start on the host's monotonic clock, seconds, this process's CPU seconds, tokens) of the last
        # steps: a client that saw a gap in its stream can tell a slow step from a slow delivery (the clock
        # is the same in every process), and a step that computed long from one the host starved
        self.recent_steps: deque[tuple[float, float, float, int]] = deque(maxlen=RECENT_STEPS)
        self.on_close: list[Callable[[], None]] = []  # e.g. stop a tensor-parallel group's workers
        self.healthy: Callable[[], bool] = lambda: True  # False once a tensor-parallel worker died

    def close(self) -> None:
        """Release what the engine started besides this process (tensor-parallel workers). Idempotent."""
        hooks, self.on_close = self.on_close, []
        for hook in hooks:
            hook()

    # -- requests -----------------------------------------------------------
    def add_request(
        self,
        prompt: str | None = None,
        *,
        images: list[bytes] | tuple[bytes, ...] = (),
        params: SamplingParams | None = None,
        messages: list[dict[str, Any]] | None = None,
        raw_prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Queue one request. ``prompt`` is one user message rendered with the chat template;
        ``messages`` a whole chat (``tools``: OpenAI function tools the template renders with it);
        ``raw_prompt`` text passed to the tokenizer unrendered; ``prompt_token_ids`` token ids as they
        are (text-only); ``mm_processor_kwargs`` the image processor's settings for this request's
        images (Qwen-VL: ``min_pixels``, ``max_pixels``)."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.prepare(request_id, params or SamplingParams(), list(images), prompt=prompt, messages=messages,
                               raw_prompt=raw_prompt, prompt_token_ids=prompt_token_ids,
                               mm_processor_kwargs=mm_processor_kwargs, **({"tools": tools} if tools else {}))
        return self.add(request)

    def prepare(self, request_id: str, params: SamplingParams, images: list[bytes],
                mm_processor_kwargs: dict[str, Any] | None = None, **prompt: Any) -> Request:
        """Intake with images embedded: tokenize with every placeholder expanded to its image's span,
        preprocess and encode the images. The prompt is checked before its images are decoded (a
        native-resolution image's token count is read off its header: ``cost``). ``prompt``: exactly one
        of Intake's prompt forms."""
        if images and self.preprocessor is None:
            raise ValueError(NO_IMAGES)
        native = bool(images) and self.model_config.image_tokens_vary
        # a native-resolution image's token count follows from its header: the prompt's length is checked
        # before any pixel is decoded
        counts = [self.preprocessor.cost(b, mm_processor_kwargs).num_tokens for b in images] if native else None  # type: ignore[union-attr]
        request, offsets = self.intake.make_request(request_id, params, len(images), image_tokens=counts, **prompt)
        if images:
            assert self.preprocessor is not None and self.encoder is not None
            processed = [self.preprocessor.process(b, None, mm_processor_kwargs) for b in images]
            attach_images(request, offsets, self.encoder.encode(processed), [p.content_hash for p in processed],
                          [p.grid_thw for p in processed])
        return request

    def add(self, request: Request) -> str:
        """Queue a request that went through intake already (images embedded): what a server hands over."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        seq = Sequence.from_request(request, self.config.block_size)
        self._requests[request.request_id] = seq
        self.scheduler.add(seq)
        return request.request_id

    def abort(self, request_id: str) -> None:
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        self.core.abort(seq)

    # -- the loop -------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        """Sequences past their prompt, producing a token per step."""
        return sum(1 for s in self.scheduler.running if not s.is_prefilling)

    def num_queued_prompt_tokens(self) -> int:
        return sum(s.num_tokens - s.num_computed_tokens for s in self._requests.values() if s.is_prefilling)

    def step(self) -> list[TokenEvent]:
        """One iteration: one forward over every running decode and as many prefill chunks as the
        rest of the token budget allows."""
        start, cpu = time.monotonic(), time.process_time()
        events = [event for _, event in self.core.step(self.config.max_num_batched_tokens)]
        self.last_step_tokens = self.core.last_num_tokens
        seconds = time.monotonic() - start
        totals = self.step_totals
        totals["steps"] += 1
        totals["seconds"] += seconds
        totals["tokens"] += self.last_step_tokens
        if self.last_step_tokens:
            self.recent_steps.append((start, seconds, time.process_time() - cpu, self.last_step_tokens))
        for ev in events:
            if ev.finished:
                self._requests.pop(ev.request_id, None)
        if not events and self.has_unfinished() and not self.core.has_work():
            raise RuntimeError("engine has unfinished requests but the scheduler holds none of them")
        return events

    def run(self) -> Iterator[TokenEvent]:
        """Step until every queued request finished, yielding token events as they come."""
        idle = 0
        while self.has_unfinished():
            events = self.step()
            idle = 0 if (events or self.last_step_tokens or self.scheduler.num_held) else idle + 1
            if idle > 100:
                raise RuntimeError("no progress for 100 steps: the KV pool is too small for the queued requests")
            yield from events

    def generate(self, requests: list[dict[str, Any]]) -> list[RequestOutput]:
        """Run a batch of requests (kwargs of :meth:`add_request`) to completion; final outputs in order."""
        ids = [self.add_request(**r) for r in requests]
        seqs = [self._requests[i] for i in ids]
        errors = {ev.request_id: ev.error for ev in self.run() if ev.finish_reason == "error"}
        return [
            RequestOutput(s.request_id, list(s.output_token_ids), s.text, s.finish_reason, s.num_prompt_tokens,
                          s.num_cached_tokens, errors.get(s.request_id),
                          s.prompt_logprobs if s.params.prompt_logprobs is not None else None)
            for s in seqs
        ]

    def stream(self, **request: Any) -> Iterator[str]:
        """Text deltas of one request as they are generated."""
        rid = self.add_request(**request)
        for ev in self.run():
            if ev.request_id != rid:
                continue
            if ev.finish_reason == "error":
                raise RequestFailed(ev.error or "the request could not be completed")
            if ev.text_delta:
                yield ev.text_delta

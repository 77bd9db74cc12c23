"""One request through the serving pipeline: a checked request in, token events out.

    prompt --Intake--> Request ; images --Preprocess--> pixels --Encode--> embeddings
    aggregated:     the LLM replica's own engine (prefill + decode, one pool) -> token-event batches
    disaggregated:  Prefill(Request) -> first event + Handoff bytes ; Decode(those bytes) -> token-event batches

Everything that crosses a deployment boundary is one msgpack message of the request contract
(``pipeline.request``, ``pipeline.handoff``). Cancelling the consumer cancels the in-flight work,
which aborts the sequence in the stage that holds it and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from strata.deployments import metrics
from strata.deployments.openai_protocol import APIError
from strata.pipeline.contract.request import Request, TokenEvent, unpack_events
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.frontend.intake import Intake, PromptTooLongError, attach_images
from strata.pipeline.frontend.tokenizer import NO_IMAGES
from strata.stages.preprocessor import ImageError

log = logging.getLogger("strata.ingress")


class RequestFlow:
    """Intake and image embedding (shared by both modes); subclasses say where tokens come from.

    Rendering the chat template and tokenizing run on worker threads, two at a time, so a huge prompt
    never blocks the replica's event loop (other requests keep streaming) and cannot pile up work. A
    structured-output grammar is compiled (in the grammar sandbox: seconds the first time) before that,
    on threads of its own, so requests without one never wait behind it."""

    def __init__(self, intake: Intake, preprocess: Any, encode: Any) -> None:
        self.intake = intake
        self.preprocess, self.encode = preprocess, encode
        self.tokenizing = asyncio.Semaphore(2)  # /tokenize and /detokenize take these slots too
        self._grammars = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check")

    async def prepare(self, request_id: str, params: SamplingParams, default_max_tokens: bool, images: list[bytes],
                      mm_processor_kwargs: dict[str, Any] | None = None, **prompt: Any) -> Request:
        """Tokenize, check lengths, embed images: the request to run. User errors -> 400. A fixed-size
        model's prompt is checked before its images are touched; a native-resolution model's images
        are preprocessed first, because their token counts are part of the prompt's length."""
        tok = self.intake.tokenizer
        if images and not tok.takes_images:
            raise APIError(400, NO_IMAGES, param="messages")
        processed = await self._preprocess(images, mm_processor_kwargs) if images and not tok.num_image_tokens else None
        counts = [p.num_tokens for p in processed] if processed is not None else None
        try:
            if params.structured is not None:
                await asyncio.get_running_loop().run_in_executor(self._grammars, self.intake.check_grammar, params)
            async with self.tokenizing:
                request, offsets = await asyncio.to_thread(
                    self.intake.make_request, request_id, params, len(images), image_tokens=counts,
                    max_tokens_default=default_max_tokens, **prompt)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), code="context_length_exceeded") from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        if images:
            processed = processed if processed is not None else await self._preprocess(images, mm_processor_kwargs)
            feats = await self.encode.encode.remote(processed)
            attach_images(request, offsets, feats, [p.content_hash for p in processed], [p.grid_thw for p in processed])
        return request

    async def _preprocess(self, images: list[bytes], mm_processor_kwargs: dict[str, Any] | None) -> list[Any]:
        processed = await asyncio.gather(*(self.preprocess.process.remote(b, mm_processor_kwargs) for b in images))
        for i, p in enumerate(processed):
            if isinstance(p, ImageError):
                if str(p).startswith("mm_processor_kwargs"):
                    raise APIError(400, str(p), param="mm_processor_kwargs")
                raise APIError(400, f"image {i}: {p}", param="messages")
        return list(processed)

    def events(self, request: Request) -> AsyncIterator[list[TokenEvent]]:
        raise NotImplementedError


class LocalFlow(RequestFlow):
    """Aggregated mode: this replica's engine service runs prefill and decode; tokens never leave it
    before they go out as HTTP (the replica that generates them is the ingress)."""

    def __init__(self, intake: Intake, preprocess: Any, encode: Any, service: Any) -> None:
        super().__init__(intake, preprocess, encode)
        self.service = service

    async def events(self, request: Request) -> AsyncIterator[list[TokenEvent]]:
        first = True
        async for batch in self.service.generate(request):
            if first:  # the prefix-cache figures the Prefill deployment records in the other mode
                metrics.prefix_tokens().inc(float(request.num_prompt_tokens), tags={"kind": "queried"})
                if batch[0].num_cached_tokens:
                    metrics.prefix_tokens().inc(float(batch[0].num_cached_tokens), tags={"kind": "hit"})
                first = False
            yield batch


class StageFlow(RequestFlow):
    """Disaggregated mode: prefill and decode deployments, KV handed over through the host tier."""

    def __init__(self, intake: Intake, preprocess: Any, encode: Any, prefill: Any, decode: Any) -> None:
        super().__init__(intake, preprocess, encode)
        self.prefill = prefill
        self.decode = decode.options(stream=True)

    async def events(self, request: Request) -> AsyncIterator[list[TokenEvent]]:
        """Token events in the batches they arrive in; the first batch is prefill's event, which
        carries ``num_cached_tokens`` (prefix-cache hit)."""
        first_frame, handoff = await self.prefill.prefill.remote(request.to_msgpack())
        first = unpack_events(first_frame)
        yield first
        if first[-1].finished:
            return
        log.debug("request %s: prefilled, streaming from decode", request.request_id)
        stream = self.decode.generate.remote(handoff)  # the bytes prefill made, never decoded here
        done = False
        try:
            async for frame in stream:
                batch = unpack_events(frame)
                done = any(event.finished for event in batch)
                yield batch
        finally:
            if not done:  # cancelled, or the consumer stopped reading: abort it in the decode replica
                stream.cancel()

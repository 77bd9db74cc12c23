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

import numpy as np

from strata.deployments.openai import request_metrics as metrics
from strata.deployments.openai.flow_trace import FlowTraces, request_bytes
from strata.deployments.openai.protocol import APIError
from strata.pipeline.contract.request import Request, TokenEvent, unpack_events
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.frontend.intake import Intake, PromptTooLongError, attach_images
from strata.pipeline.frontend.tokenizer import NO_IMAGES
from strata.stages.preprocessor import ImageError

log = logging.getLogger("strata.ingress")
BY_REFERENCE_BYTES = 1 << 20  # a call carrying more goes through Ray's object store, never over gRPC (4 MiB cap)


def by_reference(handle: Any, **options: Any) -> Any:
    """``handle`` whose calls pass their arguments and results through Ray's object store (as references),
    not over the fast path's gRPC, which refuses a message over 4 MiB either way: a photo's bytes, its pixels,
    its features, a prompt's KV tail all outgrow that. None stays None (a text-only model has no image stages)."""
    return handle.options(_by_reference=True, **options) if handle is not None else None


class RequestFlow:
    """Intake and image embedding (shared by both modes); subclasses say where tokens come from.

    Rendering the chat template and tokenizing run on worker threads, two at a time, so a huge prompt
    never blocks the replica's event loop (other requests keep streaming) and cannot pile up work. A
    structured-output grammar is compiled (in the grammar sandbox: seconds the first time) before that,
    on threads of its own, so requests without one never wait behind it."""

    def __init__(self, intake: Intake, preprocess: Any, encode: Any, counter: Any = None) -> None:
        """``counter``: the model's image preprocessor, kept here for its ``cost`` (a header read) when an
        image's token count depends on the image (native resolution, anyres)."""
        self.intake = intake
        self.counter = counter
        self.preprocess, self.encode = by_reference(preprocess), by_reference(encode)  # images: input-sized both ways
        self.tokenizing = asyncio.Semaphore(2)  # /tokenize and /detokenize take these slots too
        self.traces = FlowTraces()
        self._grammars = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check")

    async def prepare(self, request_id: str, params: SamplingParams, images: list[bytes],
                      mm_processor_kwargs: dict[str, Any] | None = None, **prompt: Any) -> Request:
        """Tokenize, check lengths, embed images: the request to run. User errors -> 400. The prompt's length
        is checked before any image is decoded: a native-resolution image's token count follows from its
        header and the processor's settings (``cost``), so a prompt too long for its images costs no pixel."""
        tok = self.intake.tokenizer
        if images and not tok.takes_images:
            raise APIError(400, NO_IMAGES, param="messages")
        counts = await self._count(images, mm_processor_kwargs) if images and not tok.num_image_tokens else None
        try:
            if params.structured is not None:
                await asyncio.get_running_loop().run_in_executor(self._grammars, self.intake.check_grammar, params)
            async with self.tokenizing:
                request, offsets = await asyncio.to_thread(
                    self.intake.make_request, request_id, params, len(images), image_tokens=counts, **prompt)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), code="context_length_exceeded") from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        if images:
            trace = self.traces.of(request_id)
            with trace.hop("preprocess", sum(len(b) for b in images)) as hop:
                processed = await self._preprocess(images, mm_processor_kwargs)
                hop.received = sum(p.pixel_values.nbytes for p in processed)
            if counts is not None and [p.num_tokens for p in processed] != counts:  # the prompt was laid out by them
                log.error("request %s: images became %s tokens, their headers said %s", request_id,
                          [p.num_tokens for p in processed], counts)
                raise APIError(500, "the images could not be prepared consistently; retry the request", type_="server_error")
            with trace.hop("encode", sum(p.pixel_values.nbytes for p in processed)) as hop:
                feats = await self.encode.encode.remote(processed)
                hop.received = sum(np.asarray(f).nbytes for f in feats)
            attach_images(request, offsets, feats, [p.content_hash for p in processed], [p.grid_thw for p in processed])
        return request

    async def _count(self, images: list[bytes], mm_processor_kwargs: dict[str, Any] | None) -> list[int]:
        """Each image's token count from its header (on a worker thread: a header read, no decoding)."""
        def count() -> list[int]:
            counts = []
            for i, image in enumerate(images):
                try:
                    counts.append(self.counter.cost(image, mm_processor_kwargs).num_tokens)
                except ImageError as exc:
                    raise _image_error(exc, i) from None
            return counts

        return await asyncio.to_thread(count)

    async def _preprocess(self, images: list[bytes], mm_processor_kwargs: dict[str, Any] | None) -> list[Any]:
        processed = await asyncio.gather(*(self.preprocess.process.remote(b, mm_processor_kwargs) for b in images))
        for i, p in enumerate(processed):
            if isinstance(p, ImageError):
                raise _image_error(p, i)
        return list(processed)

    def events(self, request: Request) -> AsyncIterator[list[TokenEvent]]:
        raise NotImplementedError


def _image_error(exc: ImageError, index: int) -> APIError:
    if str(exc).startswith("mm_processor_kwargs"):
        return APIError(400, str(exc), param="mm_processor_kwargs")
    return APIError(400, f"image {index}: {exc}", param="messages")


class LocalFlow(RequestFlow):
    """Aggregated mode: this replica's engine service runs prefill and decode; tokens never leave it
    before they go out as HTTP (the replica that generates them is the ingress)."""

    def __init__(self, intake: Intake, preprocess: Any, encode: Any, service: Any, counter: Any = None) -> None:
        super().__init__(intake, preprocess, encode, counter)
        self.service = service

    async def events(self, request: Request) -> AsyncIterator[list[TokenEvent]]:
        first = True
        with self.traces.of(request.request_id).hop("engine", request_bytes(request)) as hop:  # its process, here
            async for batch in self.service.generate(request):
                hop.received += 24 * len(batch)  # a token event packs to ~24 bytes
                if first:  # the prefix-cache figures the Prefill deployment records in the other mode
                    metrics.prefix_tokens().inc(float(request.num_prompt_tokens), tags={"kind": "queried"})
                    if batch[0].num_cached_tokens:
                        metrics.prefix_tokens().inc(float(batch[0].num_cached_tokens), tags={"kind": "hit"})
                    first = False
                yield batch


class StageFlow(RequestFlow):
    """Disaggregated mode: prefill and decode deployments, KV handed over through the host tier."""

    def __init__(self, intake: Intake, preprocess: Any, encode: Any, prefill: Any, decode: Any, counter: Any = None,
                 kv_block_bytes: int = 0) -> None:
        """``kv_block_bytes``: one KV block's size (what a full block of the prompt costs the host tier)."""
        super().__init__(intake, preprocess, encode, counter)
        self.block_size, self.kv_block_bytes = intake.config.block_size, kv_block_bytes
        # a prefill's request holds its images' features, its answer the prompt's KV tail: by reference, always
        self.prefill = by_reference(prefill)
        self.decode = decode.options(stream=True)  # a hand-off of a few KB: the fast path
        self.decode_by_reference = by_reference(decode, stream=True)  # one that carries a tail or images

    async def events(self, request: Request) -> AsyncIterator[list[TokenEvent]]:
        """Token events in the batches they arrive in; the first batch is prefill's event, which
        carries ``num_cached_tokens`` (prefix-cache hit)."""
        trace = self.traces.of(request.request_id)
        payload = request.to_msgpack()
        with trace.hop("prefill", len(payload)) as hop:
            first_frame, handoff = await self.prefill.prefill.remote(payload)
            hop.received = len(first_frame) + len(handoff)
        trace.kv_host_tier_bytes = (request.num_prompt_tokens // self.block_size) * self.kv_block_bytes
        first = unpack_events(first_frame)
        yield first
        if first[-1].finished:
            return
        log.debug("request %s: prefilled, streaming from decode", request.request_id)
        decode = self.decode_by_reference if len(handoff) > BY_REFERENCE_BYTES else self.decode
        stream = decode.generate.remote(handoff)  # the bytes prefill made, never decoded here
        done = False
        with trace.hop("decode", len(handoff)) as hop:
            try:
                async for frame in stream:
                    hop.received += len(frame)
                    batch = unpack_events(frame)
                    done = any(event.finished for event in batch)
                    yield batch
            finally:
                if not done:  # cancelled, or the consumer stopped reading: abort it in the decode replica
                    stream.cancel()

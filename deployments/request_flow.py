"""One request through the stage deployments: a checked request in, token events out.

    prompt --Intake--> Request ; images --Preprocess--> pixels --Encode--> embeddings
    Prefill(Request) -> Handoff (first token event + sequence state + KV handle)
    Decode(Handoff) -> stream of token-event batches

Everything that crosses a deployment boundary is one msgpack message of the request contract
(``pipeline.request``, ``pipeline.handoff``). Cancelling the consumer cancels the in-flight handle
call, which aborts the sequence in the stage that holds it and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from strata.deployments.openai_protocol import APIError
from strata.pipeline.handoff import Handoff
from strata.pipeline.intake import Intake, PromptTooLongError, attach_images
from strata.pipeline.request import Request, TokenEvent, unpack_events
from strata.pipeline.sampling_params import SamplingParams
from strata.stages.preprocessor import ImageError

log = logging.getLogger("strata.ingress")


class RequestFlow:
    def __init__(self, intake: Intake, preprocess: Any, encode: Any, prefill: Any, decode: Any) -> None:
        self.intake = intake
        self.preprocess, self.encode, self.prefill = preprocess, encode, prefill
        self.decode = decode.options(stream=True)

    async def prepare(self, request_id: str, params: SamplingParams, default_max_tokens: bool, images: list[bytes],
                      **prompt: Any) -> Request:
        """Tokenize, check lengths, embed images: the request to prefill. User errors -> 400."""
        try:
            request, offsets = self.intake.make_request(request_id, params, len(images),
                                                        max_tokens_default=default_max_tokens, **prompt)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), code="context_length_exceeded") from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        if images:
            await self._embed(request, images, offsets)
        return request

    async def _embed(self, request: Request, images: list[bytes], offsets: list[int]) -> None:
        processed = await asyncio.gather(*(self.preprocess.process.remote(b) for b in images))
        for i, p in enumerate(processed):
            if isinstance(p, ImageError):
                raise APIError(400, f"image {i}: {p}", param="messages")
        feats = await self.encode.encode.remote(processed)
        attach_images(request, offsets, feats, [p.content_hash for p in processed])

    async def events(self, request: Request) -> AsyncIterator[list[TokenEvent]]:
        """Token events in the batches they arrive in (a decode step's worth or more); the first
        batch is prefill's event, which carries ``num_cached_tokens`` (prefix-cache hit)."""
        handoff = Handoff.from_msgpack(await self.prefill.prefill.remote(request.to_msgpack()))
        yield [handoff.first]
        if handoff.first.finished:
            return
        log.debug("request %s: prefilled, streaming from decode", request.request_id)
        stream = self.decode.generate.remote(handoff.to_msgpack())
        done = False
        try:
            async for frame in stream:
                batch = unpack_events(frame)
                done = any(event.finished for event in batch)
                yield batch
        finally:
            if not done:  # cancelled, or the consumer stopped reading: abort it in the decode replica
                stream.cancel()

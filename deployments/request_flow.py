"""One request through the stage deployments: tokens and images in, token events out.

    prompt --encode_request--> ids ; images --Preprocess--> pixels --Encode--> embeddings
    Prefill(ids, embeddings) -> first token + KVHandle + sequence state
    Decode(sequence state, KVHandle) -> stream of token events

Cancelling the consumer cancels the in-flight handle call, which aborts the sequence in the
stage that holds it and frees its blocks.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator

import numpy as np
import torch

from deployments.openai_protocol import APIError
from pipeline.config import EngineConfig
from pipeline.request_encoding import PromptTooLongError, encode_request
from pipeline.sampling_params import SamplingParams
from pipeline.sequence import ImageEmbedding, Sequence
from pipeline.sequence_wire import sequence_to_wire
from pipeline.tokenizer import PromptTokenizer


class RequestFlow:
    def __init__(self, tokenizer: PromptTokenizer, config: EngineConfig, preprocess: Any, encode: Any,
                 prefill: Any, decode: Any) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.preprocess, self.encode, self.prefill = preprocess, encode, prefill
        self.decode = decode.options(stream=True)

    async def prepare(self, params: SamplingParams, default_max_tokens: bool, images: list[bytes],
                      **prompt: Any) -> dict[str, Any]:
        """Tokenize, check lengths, encode images; the sequence state to prefill. User errors -> 400."""
        if default_max_tokens:  # OpenAI default: whatever room the context leaves
            params.max_tokens = 1
        try:
            encoded = encode_request(self.tokenizer, self.config, params, len(images), **prompt)
        except PromptTooLongError as exc:
            raise APIError(400, str(exc), code="context_length_exceeded") from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        if default_max_tokens:
            params.max_tokens = max(1, self.config.max_model_len - len(encoded.token_ids))
        embeds = await self._embed(images, encoded.image_offsets)
        seq = Sequence(uuid.uuid4().hex, encoded.token_ids, params, self.config.block_size, embeds)
        return sequence_to_wire(seq)

    async def _embed(self, images: list[bytes], offsets: list[int]) -> list[ImageEmbedding]:
        if not images:
            return []
        pixels = await asyncio.gather(*(self.preprocess.process.remote(b) for b in images))
        for i, p in enumerate(pixels):
            if "error" in p:
                raise APIError(400, f"image {i}: {p['error']}", param="messages")
        feats = await self.encode.encode.remote(pixels)
        return [
            ImageEmbedding(off, torch.from_numpy(np.array(f, copy=True)), p["hash"])
            for off, f, p in zip(offsets, feats, pixels)
        ]

    async def events(self, wire: dict[str, Any]) -> AsyncIterator[list[dict[str, Any]]]:
        """Token events in the batches they arrive in (a decode step's worth or more); the first
        batch is prefill's token and carries ``num_cached_tokens`` (prefix-cache hit)."""
        first = await self.prefill.prefill.remote(wire)
        yield [{k: first[k] for k in ("token_id", "text_delta", "finished", "finish_reason", "num_cached_tokens")}]
        if first["finished"]:
            return
        stream = self.decode.generate.remote(first["seq"], first["handle"])
        done = False
        try:
            async for batch in stream:
                done = any(event["finished"] for event in batch)
                yield batch
        finally:
            if not done:  # cancelled, or the consumer stopped reading: abort it in the decode replica
                stream.cancel()

"""In-process engine: the four stages composed in one process (numerics tests, `strata generate`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from pipeline.config import EngineConfig
from pipeline.model_config import LlavaConfig
from pipeline.request_encoding import encode_request
from pipeline.sampling_params import SamplingParams
from pipeline.sequence import ImageEmbedding, Sequence
from pipeline.stage_api import DecoderLike, EncoderLike, PrefillerLike, PreprocessorLike
from pipeline.tokenizer import PromptTokenizer


@dataclass
class RequestOutput:
    """Incremental result of one request after one engine step."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    output_token_ids: list[int] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        model_config: LlavaConfig,
        tokenizer: PromptTokenizer,
        preprocessor: PreprocessorLike,
        encoder: EncoderLike,
        prefiller: PrefillerLike,
        decoder: DecoderLike,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.preprocessor = preprocessor
        self.encoder = encoder
        self.prefiller = prefiller
        self.decoder = decoder
        # New prompts must leave one free block per running decode, or admissions would starve them.
        prefiller.set_admission_watermark(lambda: decoder.num_running)
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.last_step_tokens = 0

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
    ) -> str:
        """Queue one request. ``prompt`` is one user message rendered with the chat template;
        ``messages`` a whole chat; ``raw_prompt`` text passed to the tokenizer unrendered;
        ``prompt_token_ids`` token ids as they are (text-only)."""
        params = params or SamplingParams()
        encoded = encode_request(
            self.tokenizer, self.config, params, len(images),
            prompt=prompt, messages=messages, raw_prompt=raw_prompt, prompt_token_ids=prompt_token_ids,
        )
        embeds = self._encode_images(list(images), encoded.image_offsets)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, encoded.token_ids, params, self.config.block_size, embeds)
        self._requests[request_id] = seq
        self.prefiller.add(seq)
        return request_id

    def _encode_images(self, images: list[bytes], offsets: list[int]) -> list[ImageEmbedding]:
        if not images:
            return []
        processed = [self.preprocessor.process(b) for b in images]
        feats = self.encoder.encode(processed)
        return [
            ImageEmbedding(off, torch.from_numpy(f), p.content_hash) for off, f, p in zip(offsets, feats, processed)
        ]

    def abort(self, request_id: str) -> None:
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        for stage in (self.decoder, self.prefiller):
            stage.abort(seq)

    # -- the loop -------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """One iteration: decode every running sequence, then spend what is left of the budget on prefill."""
        outputs: list[RequestOutput] = []
        events = self.decoder.step(self.config.max_num_batched_tokens)
        used = self.decoder.last_num_tokens
        budget = self.config.max_num_batched_tokens - used
        self.last_step_tokens = used
        if budget > 0:
            for result in self.prefiller.step(budget):
                if result.handle is not None:
                    self.decoder.admit(result.seq, result.handle)
                events.append(result.first)
            self.last_step_tokens += self.prefiller.last_num_tokens
        for ev in events:
            outputs.append(self._output(ev.seq, [ev.token_id], ev.text_delta, ev.finished))
        if not events and self.has_unfinished() and not (self.prefiller.has_work() or self.decoder.has_work()):
            raise RuntimeError("engine has unfinished requests but no stage holds them")
        return outputs

    def _output(self, seq: Sequence, new: list[int], delta: str, finished: bool) -> RequestOutput:
        if finished:
            self._requests.pop(seq.seq_id, None)
        return RequestOutput(
            request_id=seq.seq_id,
            new_token_ids=new,
            text_delta=delta,
            finished=finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            output_token_ids=list(seq.output_token_ids) if finished else [],
        )

    def run(self) -> Iterator[RequestOutput]:
        """Step until every queued request finished, yielding outputs as they come."""
        idle = 0
        while self.has_unfinished():
            outs = self.step()
            idle = 0 if (outs or self.last_step_tokens) else idle + 1
            if idle > 100:
                raise RuntimeError("no progress for 100 steps: the KV pool is too small for the queued requests")
            yield from outs

    def generate(self, requests: list[dict[str, Any]]) -> list[RequestOutput]:
        """Run a batch of requests (kwargs of :meth:`add_request`) to completion; final outputs in order."""
        ids = [self.add_request(**r) for r in requests]
        final = {o.request_id: o for o in self.run() if o.finished}
        return [final[i] for i in ids]

    def stream(self, **request: Any) -> Iterator[str]:
        """Text deltas of one request as they are generated."""
        rid = self.add_request(**request)
        for out in self.run():
            if out.request_id == rid and out.text_delta:
                yield out.text_delta

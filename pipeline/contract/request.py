"""The request contract across stages: what a request is, and what "a token came out" looks like.

Each message is a ``msgspec.Struct`` declared once, with its kind and version; ``contract.wire``
encodes it. Decoding checks both, so a replica of another release is refused by name.

* :class:`Request` - a checked prompt (token ids, sampling params, image embeddings, arrival time)
  entering prefill; made by :mod:`pipeline.frontend.intake` for the in-process engine and the HTTP
  ingress alike.
* :class:`TokenEvent` - one generated token of one request, with its new text and, on the
  last one, the finish reason. Every stage emits these; the ingress turns them into SSE.
  :class:`EventBatch` carries one step's events for any number of requests.
* :class:`~pipeline.contract.handoff.Handoff` - prefill's state handed to decode.

``request_id`` is the id the client sees (the OpenAI response id through the server), so one
request can be followed through every stage's logs and events.
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal

import msgspec
import numpy as np

from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.contract.wire import decode, encode


class ImageEmbedding(msgspec.Struct):
    """An image's placeholder span in the prompt and the embeddings that replace it (float32 numpy:
    one representation from the encoder to the model runner, which views it as a tensor)."""

    offset: int
    embeds: np.ndarray  # [length, text_hidden] float32
    content_hash: bytes  # of the image's bytes and, at native resolution, of the grid it was resized to
    grid_thw: tuple[int, int, int] | None = None  # native resolution: the processor's patch grid (frames, rows, cols)
    # Qwen3-VL's DeepStack: [levels, length, text_hidden] float32, added to the first decoder layers' outputs
    deepstack: np.ndarray | None = None

    @property
    def length(self) -> int:
        return int(self.embeds.shape[0])


class Request(msgspec.Struct, tag_field="kind", tag="request"):
    """A checked prompt on its way to prefill."""

    VERSION: ClassVar[int] = 2  # v2: the arrival time travels with the request

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    images: list[ImageEmbedding] = msgspec.field(default_factory=list)
    # when the whole request had arrived (wall clock, so it means the same in every process of a
    # cluster): every stage's deadline counts from here, not from when that stage took it over
    arrival_time: float = msgspec.field(default_factory=time.time)
    v: Literal[2] = 2

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def to_msgpack(self) -> bytes:
        return encode(self)

    @classmethod
    def from_msgpack(cls, data: bytes) -> "Request":
        return decode(data, cls)


class PromptLogprob(msgspec.Struct, array_like=True):
    """One prompt token's log-probability given the tokens before it, its rank (1: the most likely), and
    the most likely tokens at its position (as many as the request asked for)."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


class TokenEvent(msgspec.Struct, array_like=True):
    """One generated token of one request (a list on the wire: events are the hottest message)."""

    request_id: str
    token_id: int  # -1 on an error event (no token came out)
    text_delta: str = ""
    finish_reason: str | None = None  # set on the request's last event: stop, length, abort, error
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # with finish_reason "error": what went wrong, in words fit for the client
    logprob: float | None = None  # of token_id, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # the most likely tokens of this position
    # on a request's first event, when it asked for prompt logprobs: one per prompt token after the first
    prompt_logprobs: list[PromptLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failure(cls, request_id: str, message: str) -> "TokenEvent":
        """The last event of a request that could not be completed."""
        return cls(request_id, -1, "", "error", 0, message)


class EventBatch(msgspec.Struct, tag_field="kind", tag="events"):
    """A batch of events (one decode step's worth, for any number of requests) as one message."""

    VERSION: ClassVar[int] = 2  # v2: declared (msgspec) encoding

    events: list[TokenEvent]
    v: Literal[2] = 2


def pack_events(events: list[TokenEvent]) -> bytes:
    return encode(EventBatch(events))


def unpack_events(data: bytes) -> list[TokenEvent]:
    return decode(data, EventBatch).events

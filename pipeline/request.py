"""The request contract across stages: what a request is, and what "a token came out" looks like.

One typed dataclass per message, each with one msgpack encoding (``pipeline.wire``):

* :class:`Request` - a checked prompt (token ids, sampling params, image embeddings) entering
  prefill; made by :mod:`pipeline.intake` for the in-process engine and the HTTP ingress alike.
* :class:`TokenEvent` - one generated token of one request, with its new text and, on the
  last one, the finish reason. Every stage emits these; the ingress turns them into SSE.
* :class:`~pipeline.handoff.Handoff` - prefill's state handed to decode.

``request_id`` is the id the client sees (the OpenAI response id through the server), so one
request can be followed through every stage's logs and events.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from strata.kvstore import ImageSpan
from strata.pipeline.sampling_params import SamplingParams
from strata.pipeline.wire import message, open_message

REQUEST_VERSION = 1
EVENTS_VERSION = 1


@dataclass
class ImageEmbedding:
    """An image's placeholder span in the prompt and the embeddings that replace it (float32 numpy:
    one representation from the encoder to the model runner, which views it as a tensor)."""

    offset: int
    embeds: np.ndarray  # [length, text_hidden] float32
    content_hash: bytes

    @property
    def length(self) -> int:
        return int(self.embeds.shape[0])

    def span(self) -> ImageSpan:
        return ImageSpan(self.offset, self.length, self.content_hash)

    def to_obj(self) -> list[Any]:
        return [self.offset, self.embeds, self.content_hash]

    @classmethod
    def from_obj(cls, obj: list[Any]) -> "ImageEmbedding":
        offset, embeds, content_hash = obj
        return cls(int(offset), np.asarray(embeds, dtype=np.float32), bytes(content_hash))


@dataclass
class Request:
    """A checked prompt on its way to prefill."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    images: list[ImageEmbedding] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def to_msgpack(self) -> bytes:
        return message("request", REQUEST_VERSION, id=self.request_id, prompt=self.prompt_token_ids,
                       params=asdict(self.params), images=[i.to_obj() for i in self.images])

    @classmethod
    def from_msgpack(cls, data: bytes) -> "Request":
        obj = open_message(data, "request", REQUEST_VERSION)
        return cls(obj["id"], list(obj["prompt"]), SamplingParams(**obj["params"]),
                   [ImageEmbedding.from_obj(i) for i in obj["images"]])


@dataclass
class TokenEvent:
    """One generated token of one request."""

    request_id: str
    token_id: int  # -1 on an error event (no token came out)
    text_delta: str = ""
    finish_reason: str | None = None  # set on the request's last event: eos, stop, length, abort, error
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # with finish_reason "error": what went wrong, in words fit for the client
    logprob: float | None = None  # of token_id, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # the most likely tokens of this position

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failure(cls, request_id: str, message: str) -> "TokenEvent":
        """The last event of a request that could not be completed."""
        return cls(request_id, -1, "", "error", 0, message)

    def to_obj(self) -> list[Any]:
        return [self.request_id, self.token_id, self.text_delta, self.finish_reason, self.num_cached_tokens,
                self.error, self.logprob, [list(t) for t in self.top_logprobs] if self.top_logprobs is not None else None]

    @classmethod
    def from_obj(cls, obj: list[Any]) -> "TokenEvent":
        event = cls(*obj)
        if event.top_logprobs is not None:
            event.top_logprobs = [(int(t), float(p)) for t, p in event.top_logprobs]
        return event


def pack_events(events: list[TokenEvent]) -> bytes:
    """A batch of events (one decode step's worth, for any number of requests) as one message."""
    return message("events", EVENTS_VERSION, events=[e.to_obj() for e in events])


def unpack_events(data: bytes) -> list[TokenEvent]:
    obj = open_message(data, "events", EVENTS_VERSION)
    return [TokenEvent.from_obj(e) for e in obj["events"]]

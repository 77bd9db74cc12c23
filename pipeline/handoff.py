"""Prefill's hand-off to decode: the sequence state plus a handle to its KV, as one message.

Carries what decoding needs to continue exactly where prefill stopped: every token so far,
the sampling params, the sampler's generator state (a seeded request stays reproducible), the
detokenizer offsets and emitted text (no repeated or lost characters), the image embeddings (a
recompute after preemption needs them) and prefill's token event. KV is not in here: the
``kv_handle`` (a msgpack :class:`~kvstore.KVHandle`) names it in the KV store.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from strata.pipeline.detokenizer import IncrementalDetokenizer
from strata.pipeline.request import ImageEmbedding, TokenEvent
from strata.pipeline.sampling_params import SamplingParams
from strata.pipeline.sequence import Sequence
from strata.pipeline.wire import message, open_message

HANDOFF_VERSION = 1


@dataclass
class Handoff:
    request_id: str
    token_ids: list[int]  # prompt + the tokens generated so far
    num_prompt_tokens: int
    params: SamplingParams
    first: TokenEvent  # prefill's token event (its token is the last of token_ids)
    kv_handle: bytes
    images: list[ImageEmbedding] = field(default_factory=list)
    tail_kv: bytes = b""  # the partial last block's KV (every layer), so decode does not recompute it
    generator_state: bytes | None = None
    text: str = ""
    emitted_text_len: int = 0
    detokenizer: tuple[int, int] = (0, 0)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    source: str = ""  # the node whose host tier holds the full blocks ("": this node's)

    @classmethod
    def from_sequence(cls, seq: Sequence, first: TokenEvent, kv_handle: bytes, tail_kv: bytes = b"") -> "Handoff":
        state = seq.generator.get_state().numpy().tobytes() if seq.generator is not None else None
        return cls(
            seq.request_id, list(seq.token_ids), seq.num_prompt_tokens, seq.params, first, kv_handle,
            list(seq.images), tail_kv, state, seq.text, seq.emitted_text_len,
            (seq.detokenizer.prefix_offset, seq.detokenizer.read_offset), seq.num_cached_tokens, seq.num_preemptions,
        )

    def to_sequence(self, block_size: int) -> Sequence:
        """A WAITING sequence with no KV; the decoder admits it with ``kv_handle``."""
        seq = Sequence(self.request_id, self.token_ids[: self.num_prompt_tokens], self.params, block_size, self.images)
        seq.token_ids = list(self.token_ids)
        if self.generator_state is not None:
            assert seq.generator is not None
            seq.generator.set_state(torch.from_numpy(np.frombuffer(self.generator_state, dtype=np.uint8).copy()))
        seq.text = self.text
        seq.emitted_text_len = self.emitted_text_len
        seq.detokenizer = IncrementalDetokenizer(*self.detokenizer)
        seq.num_cached_tokens = self.num_cached_tokens
        seq.num_preemptions = self.num_preemptions
        return seq

    def to_msgpack(self) -> bytes:
        return message(
            "handoff", HANDOFF_VERSION, id=self.request_id, tokens=self.token_ids, prompt_len=self.num_prompt_tokens,
            params=asdict(self.params), first=self.first.to_obj(), kv=self.kv_handle, tail=self.tail_kv,
            images=[i.to_obj() for i in self.images], generator=self.generator_state, text=self.text,
            emitted=self.emitted_text_len, detok=list(self.detokenizer), cached=self.num_cached_tokens,
            preemptions=self.num_preemptions, src=self.source,
        )

    @classmethod
    def from_msgpack(cls, data: bytes) -> "Handoff":
        o = open_message(data, "handoff", HANDOFF_VERSION)
        return cls(
            o["id"], list(o["tokens"]), o["prompt_len"], SamplingParams(**o["params"]), TokenEvent.from_obj(o["first"]),
            o["kv"], [ImageEmbedding.from_obj(i) for i in o["images"]], o["tail"], o["generator"], o["text"], o["emitted"],
            tuple(o["detok"]), o["cached"], o["preemptions"], o.get("src", ""),
        )

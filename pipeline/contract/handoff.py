"""Prefill's hand-off to decode: the sequence's state plus a handle to its KV, as one message.

:class:`SequenceState` is everything about a request that must survive a move between processes:
every token so far, the sampling params, the sampler's generator state (a seeded request stays
reproducible), the detokenizer offsets and emitted text (no repeated or lost characters), the image
embeddings (a recompute after preemption needs them), the prefix-cache figure and the arrival time
(the deadline keeps counting). It is declared once: ``core.sequence`` copies a ``Sequence`` into it
and back field by field, by name, so a field added here reaches decode with no other change than
the ``Sequence`` attribute of the same name. KV is not in here: ``kv_handle`` (a
:class:`~kvstore.KVHandle`, declared in the KV store and encoded with the rest) names it there, and
``tail_kv`` carries the partial last block, and ``linear_state`` a linear-attention model's per-sequence
state after the prompt (``kvstore.StateCache.export``), which no block holds.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from strata.kvstore.handle import KVHandle
from strata.pipeline.contract.request import ImageEmbedding, TokenEvent
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.contract.wire import decode, encode


class SequenceState(msgspec.Struct):
    """A request's state between steps (what a ``Sequence`` is, without its KV)."""

    request_id: str
    token_ids: list[int]  # prompt + the tokens generated so far
    num_prompt_tokens: int
    params: SamplingParams
    images: list[ImageEmbedding] = msgspec.field(default_factory=list)
    generator_state: bytes | None = None
    text: str = ""
    emitted_text_len: int = 0
    detokenizer: tuple[int, int] = (0, 0)  # the incremental detokenizer's (prefix, read) offsets
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0  # the request's (wall clock): decode's deadline counts from it too


class Handoff(msgspec.Struct, tag_field="kind", tag="handoff"):
    """One prefilled request, ready for a decode stage to continue."""

    VERSION: ClassVar[int] = 4  # v4: a hybrid's linear state; v3: the KV handle declared; v2: declared state

    state: SequenceState
    first: TokenEvent  # prefill's token event (its token is the last of state.token_ids)
    kv_handle: KVHandle | None = None  # None: the first token already finished the request
    tail_kv: bytes = b""  # the partial last block's KV (every layer), so decode does not recompute it
    source: str = ""  # the node whose host tier holds the full blocks ("": this node's)
    linear_state: bytes = b""  # a linear-attention model's state after the prompt (every linear layer)
    v: Literal[4] = 4

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def num_cached_tokens(self) -> int:
        return self.state.num_cached_tokens

    def to_msgpack(self) -> bytes:
        return encode(self)

    @classmethod
    def from_msgpack(cls, data: bytes) -> "Handoff":
        return decode(data, cls)

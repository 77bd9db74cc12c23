"""One request's state inside an engine core: tokens, KV blocks, images, sampling state."""

from __future__ import annotations

import enum
import time
from typing import Any

import numpy as np
import torch

from strata.kvstore import BlockTable, ImageSpan, KVHandle, hash_chain
from strata.pipeline.contract.handoff import Handoff, SequenceState
from strata.pipeline.contract.request import ImageEmbedding, PromptLogprob, Request, TokenEvent
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.logits_processors import TokenCounts
from strata.pipeline.core.sampler import make_generator
from strata.pipeline.frontend.detokenizer import IncrementalDetokenizer
from strata.pipeline.models.mrope import MRopeLayout


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens known so far (prompt + generated), how many have KV in the cache, and where."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        images: list[ImageEmbedding] | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.images = list(images or [])
        # what the block hashes commit to for each image: its placeholder span and its content
        self.image_spans = [ImageSpan(img.offset, img.length, img.content_hash) for img in self.images]
        self.block_table = BlockTable(block_size)
        self.block_hashes: list[bytes] = []  # hash chain of the full blocks of token_ids (computed lazily)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache on admission
        self.num_preemptions = 0
        self.lost_blocks: set[bytes] = set()  # spilled blocks found lost: never looked up again
        self.prefetched = False  # its cached prefix's lower-tier blocks were asked to be read ahead
        self.mrope_layout: MRopeLayout | None = None  # M-RoPE models: built from the images where it runs
        self.token_counts: TokenCounts | None = None  # penalties: kept by the logits processors where it runs
        self.grammar_matcher: Any = None  # structured output: llguidance's matcher, made where it runs
        self.grammar_template: Any = None  # its compiled grammar, once ready there (``core.grammar``)
        self.grammar_stop = False  # a stop token came where its grammar was complete: the answer ends
        self.trigger_searched = False  # its output was searched for the grammar's trigger token (``core.grammar``)
        self.kv_losses = 0
        self.draft: list[int] = []  # speculative tokens proposed for its next step (``core.speculation``)
        self.lookup_ids: Any = None  # its tokens as an array for prompt lookup (``core.speculation.TokenArray``)
        self.mtp_draft: tuple[int, int] | None = None  # (its token count then, token) the MTP layer drafted last
        self.draft_limit = 0  # the most it may draft next (0: the configured number), after how its drafts fared
        self.arrival_time = time.time()  # when the request arrived (wall clock; travels with hand-offs)
        self.arrival = time.monotonic()  # the same instant on this process's monotonic clock (deadlines)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.generator = make_generator(params.seed)
        self.text = ""  # detokenized output so far
        self.detokenizer = IncrementalDetokenizer()
        self.emitted_text_len = 0  # characters already streamed to the client
        self.prompt_logprobs: list[PromptLogprob] = []  # of prompt tokens 1.. as their rows ran (``core.prompt_logprobs``)

    @classmethod
    def from_request(cls, request: Request, block_size: int) -> "Sequence":
        seq = cls(request.request_id, request.prompt_token_ids, request.params, block_size, request.images)
        seq.arrived_at(request.arrival_time)
        return seq

    def arrived_at(self, wall_time: float) -> None:
        """Date the request's arrival back to ``wall_time`` (it arrived in another stage or process)."""
        self.arrival_time = wall_time
        self.arrival = time.monotonic() - max(0.0, time.time() - wall_time)

    # ------------------------------------------------------------ moving between processes
    def state(self) -> SequenceState:
        """This sequence's state for another process, every field of :class:`SequenceState` by name
        (a field added there travels as soon as the attribute of the same name exists here)."""
        return SequenceState(**{name: self._state_value(name) for name in SequenceState.__struct_fields__})

    def _state_value(self, name: str) -> Any:
        if name == "generator_state":
            return self.generator.get_state().numpy().tobytes() if self.generator is not None else None
        if name == "detokenizer":
            return (self.detokenizer.prefix_offset, self.detokenizer.read_offset)
        value = getattr(self, name)
        return list(value) if isinstance(value, list) else value

    @classmethod
    def from_state(cls, state: SequenceState, block_size: int) -> "Sequence":
        """A WAITING sequence with no KV, continuing exactly where ``state`` stands."""
        seq = cls(state.request_id, state.token_ids[: state.num_prompt_tokens], state.params, block_size, state.images)
        for name in SequenceState.__struct_fields__:
            value = getattr(state, name)
            if name == "generator_state":
                if value is not None:
                    assert seq.generator is not None
                    seq.generator.set_state(torch.from_numpy(np.frombuffer(value, dtype=np.uint8).copy()))
            elif name == "detokenizer":
                seq.detokenizer = IncrementalDetokenizer(*value)
            elif name == "arrival_time":
                seq.arrived_at(value)
            elif name not in ("request_id", "num_prompt_tokens", "params", "images"):  # set by the constructor
                setattr(seq, name, list(value) if isinstance(value, list) else value)
        return seq

    def to_handoff(self, first: TokenEvent, kv_handle: KVHandle | None, tail_kv: bytes = b"",
                   linear_state: bytes = b"") -> Handoff:
        """What decode needs to continue exactly where this (prefilled) sequence stands."""
        return Handoff(self.state(), first, kv_handle, tail_kv, linear_state=linear_state)

    @classmethod
    def from_handoff(cls, handoff: Handoff, block_size: int) -> "Sequence":
        """A WAITING sequence with no KV; the decoder admits it with ``handoff.kv_handle``."""
        return cls.from_state(handoff.state, block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefilling(self) -> bool:
        """More than one token lacks KV: a prompt (or a recompute after preemption) is being prefilled."""
        return self.num_tokens - self.num_computed_tokens > 1

    def full_block_hashes(self, fingerprint: bytes, num_blocks: int) -> list[bytes]:
        """Hashes of the first ``num_blocks`` full blocks, extending the cached chain incrementally."""
        if num_blocks > len(self.block_hashes):
            bs = self.block_table.block_size
            self.block_hashes = hash_chain(
                fingerprint, self.token_ids[: num_blocks * bs], bs, self.image_spans, self.block_hashes
            )
        return self.block_hashes[:num_blocks]

    def reset_for_recompute(self) -> None:
        """Forget all KV (after preemption): the sequence will be prefilled again, prompt + output."""
        self.block_table = BlockTable(self.block_table.block_size)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

"""One request's state inside an engine core: tokens, KV blocks, images, sampling state."""

from __future__ import annotations

import enum
import time

from strata.kvstore import BlockTable, hash_chain
from strata.pipeline.detokenizer import IncrementalDetokenizer
from strata.pipeline.request import ImageEmbedding, Request
from strata.pipeline.sampler import make_generator
from strata.pipeline.sampling_params import SamplingParams


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
        self.image_spans = [img.span() for img in self.images]
        self.block_table = BlockTable(block_size)
        self.block_hashes: list[bytes] = []  # hash chain of the full blocks of token_ids (computed lazily)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache on admission
        self.num_preemptions = 0
        self.lost_blocks: set[bytes] = set()  # spilled blocks found lost: never looked up again
        self.kv_losses = 0
        self.arrival = time.monotonic()  # for the per-request deadline
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.generator = make_generator(params.seed)
        self.text = ""  # detokenized output so far
        self.detokenizer = IncrementalDetokenizer()
        self.emitted_text_len = 0  # characters already streamed to the client

    @classmethod
    def from_request(cls, request: Request, block_size: int) -> "Sequence":
        return cls(request.request_id, request.prompt_token_ids, request.params, block_size, request.images)

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

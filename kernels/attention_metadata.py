"""The one description of a batch that every attention backend reads (vLLM-style), built once per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np
import torch


class SpilledKV(Protocol):
    """A sequence's oldest KV blocks that are not on the device: positions
    ``0 .. num_blocks * block_size - 1``, streamed back one layer and one segment at a time."""

    num_blocks: int
    segment_blocks: int  # most blocks one ``load`` may return (the staging buffer's size)

    def load(self, layer: int, first_block: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [num_blocks, block_size, Hkv, D] of ``layer``; valid until the next load. A source
        may also offer ``prefetch(layer, first_block, num_blocks)`` to stage the next segment early."""
        ...


@dataclass
class AttentionMetadata:
    """Where each sequence's new queries sit and where its keys live in the paged cache.

    The batch is flattened: sequence ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``; those are its *last* query tokens, so the
    absolute position of query row ``j`` of sequence ``i`` is
    ``seq_lens[i] - query_len_i + j``. Keys of sequence ``i`` are token positions
    ``kv_offsets[i] .. seq_lens[i]-1`` stored in blocks ``block_tables[i, :]``; keys before
    ``kv_offsets[i]`` (block aligned) are off the device, described by ``spilled[i]``.

    Built once per step and read by every layer: tensors live on the model's device, the python
    lists let backends branch without a device sync, and ``prepared`` holds what a backend derives
    from the metadata (its partition of the batch, say) so the work is not repeated per layer.
    """

    query_start_loc: torch.Tensor  # int64 [num_seqs + 1]
    seq_lens: torch.Tensor  # int64 [num_seqs], kv length after this step's tokens are written
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens], flat cache slot of each new token
    block_size: int
    query_lens: list[int]
    seq_lens_list: list[int]
    kv_offsets: list[int] = field(default_factory=list)  # first key position in the block table, per sequence
    spilled: list[SpilledKV | None] | None = None  # None when every key is on the device
    kv_offsets_t: torch.Tensor | None = None  # int64 [num_seqs], the same as a tensor
    slot_blocks: torch.Tensor | None = None  # int64 [num_tokens]: slot_mapping // block_size
    slot_offsets: torch.Tensor | None = None  # int64 [num_tokens]: slot_mapping % block_size
    prepared: dict[Any, Any] = field(default_factory=dict)
    # per model layer, the metadata it attends with when cache groups differ (a sliding-window group reads
    # its own slots from its window's start: ``kvstore.window_claims``); None: every layer uses this one
    by_layer: tuple[AttentionMetadata, ...] | None = None
    states: Any = None  # the step's linear-attention states (``models.linear_mixer.LinearStates``), if any
    prompt_lens: list[int] = field(default_factory=list)  # per sequence, its prompt's length (DSA's top-k rule)
    sparse_reads: Any = None  # where sparse attention counts what it read (``kvstore.sparse_reads.SparseReads``)
    layer_mirror: Any = None  # the device copy of small layers' spilled blocks (``kvstore.layer_mirror``), if any
    token_ids: torch.Tensor | None = None  # int64 [num_tokens]: the step's tokens (DeepSeek-V4's hash-routed layers)

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self if self.by_layer is None else self.by_layer[layer]

    def prompt_len(self, i: int) -> int:
        """Sequence ``i``'s prompt length (0 when the runner did not say: every row counts as generated)."""
        return self.prompt_lens[i] if self.prompt_lens else 0

    def kv_offset(self, i: int) -> int:
        return self.kv_offsets[i] if self.kv_offsets else 0

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
        kv_offsets: Sequence[int] | None = None,
        spilled: Sequence[SpilledKV | None] | None = None,
    ) -> "AttentionMetadata":
        """Assemble tensors from plain lists (what the model runner has at hand): one tensor per field."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        offsets = list(kv_offsets) if kv_offsets is not None else [0] * len(query_lens)
        slots = torch.tensor(slot_mapping, dtype=torch.int64, device=device)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            # through numpy: torch.tensor of a long context's block table (8,192 ints at 128K) is 4x slower
            block_tables=torch.from_numpy(np.array(padded, dtype=np.int32).reshape(len(block_tables), width))
            .to(device),
            slot_mapping=slots,
            block_size=block_size,
            query_lens=list(query_lens),
            seq_lens_list=list(seq_lens),
            kv_offsets=offsets if any(offsets) else [],
            spilled=list(spilled) if spilled is not None and any(o is not None for o in spilled) else None,
            kv_offsets_t=torch.tensor(offsets, dtype=torch.int64, device=device),
            slot_blocks=torch.div(slots, block_size, rounding_mode="floor"),
            slot_offsets=torch.remainder(slots, block_size),
        )

"""One DeepSeek-V4 layer's paged caches for a whole step: the step's writes at once, and a decode batch's reads.

``attention_v4.V4Attention`` writes every row's K=V and compressor projections in one indexed store per tensor
(the window groups' slot mapping covers every row of the step). Sequences with one new row whose blocks are all
on the device (a decode step's usual case) are read together: each row's window, its sequence's entries padded
to the longest and the CSA entries it chose come back as [batch, ...] tensors with a mask, so a step of many
sequences attends in one batched product. Anything else (a prefill chunk, a context with spilled blocks) is
read sequence by sequence through :class:`v4_paged_cache.PagedV4Cache`, which also loads from the tiers.
"""

from __future__ import annotations

import torch

from strata.kernels import AttentionMetadata
from strata.pipeline.models.compressed_attention_config import CompressedAttentionConfig
from strata.pipeline.models.v4_paged_cache import PagedV4Cache, V4CacheFormat


class PagedV4Step:
    """Model layer ``layer``'s caches of every sequence in the step (:class:`attention_v4.V4StepCache`)."""

    def __init__(self, kv: list[torch.Tensor], meta: AttentionMetadata, layer: int,
                 cfg: CompressedAttentionConfig, fmt: V4CacheFormat) -> None:
        self.kv, self.meta, self.layer, self.cfg, self.fmt = kv, meta, layer, cfg, fmt
        self.places = self.sequence(0)  # the layer's column and entry places: the same for every sequence

    def sequence(self, i: int) -> PagedV4Cache:
        return PagedV4Cache(self.kv, self.meta, i, self.layer, self.cfg, self.fmt)

    def _write(self, layer: int, values: torch.Tensor, lo: int, hi: int) -> None:
        """Every row of the step into KV-layout ``layer``, values [rows, width] at columns lo..hi."""
        m = self.meta.for_layer(layer)
        self.kv[layer][m.slot_blocks, 0, m.slot_offsets, 0, lo:hi] = self.fmt.store(layer, values, self.kv[layer].dtype)

    def write_kv(self, kv: torch.Tensor) -> None:
        self._write(self.layer, kv, 0, kv.shape[-1])

    def write_projections(self, name: str, kv: torch.Tensor, gate: torch.Tensor) -> None:
        lo, mid, hi = self.places.projection_columns(name)
        self._write(self.places.projection_layer, kv, lo, mid)
        self._write(self.places.projection_layer, gate, mid, hi)

    def batchable(self, i: int) -> bool:
        """Whether sequence ``i`` may join a decode batch: every block of it on the device (a sequence with
        spilled blocks is read alone, which loads from the tiers)."""
        return not self.meta.kv_offset(i)

    def decode_batch(self, seqs: list[int]) -> PagedV4Decode:
        """The one-row, batchable sequences ``seqs`` read together."""
        return PagedV4Decode(self, seqs)


class PagedV4Decode:
    """One-row sequences of the step, every block on the device: their windows and entries as padded batches."""

    def __init__(self, step: PagedV4Step, seqs: list[int]) -> None:
        meta = step.meta
        self.step, self.meta = step, meta
        self.seqs = torch.tensor(seqs, dtype=torch.int64, device=meta.block_tables.device)
        self.positions = meta.seq_lens[self.seqs] - 1  # each sequence's new row
        self.places = step.places

    def window(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's last ``size`` positions of K=V: keys [B, size, D] and which exist [B, size]."""
        m = self.meta.for_layer(self.step.layer)
        positions = self.positions[:, None] - size + 1 + torch.arange(size, device=self.positions.device)[None, :]
        valid = positions >= 0
        held = positions - m.kv_offsets_t[self.seqs, None] if m.kv_offsets_t is not None else positions
        if bool((valid & (held < 0)).any()):
            raise RuntimeError("a decode row's window starts before the blocks kept on the device")
        held = held.clamp(min=0)
        blocks = m.block_tables[self.seqs[:, None], torch.div(held, m.block_size, rounding_mode="floor")].long()
        layer = self.step.layer
        return self.step.fmt.widen(layer, self.step.kv[layer][blocks, 0, held % m.block_size, 0]), valid

    def entries(self, name: str, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's first ``counts`` entries, padded to the most: [B, E, width] and which exist [B, E]."""
        ids = torch.arange(int(counts.max()), device=counts.device)[None, :].expand(len(counts), -1)
        valid = ids < counts[:, None]
        return self.entries_at(name, torch.where(valid, ids, 0)), valid

    def entries_at(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Entries ``ids`` [B, k] (non-negative) of each sequence: [B, k, width]."""
        blocks, rows = self.places.entry_places(ids)
        layer = self.places.entry_layer(name)
        table = self.meta.block_tables[self.seqs[:, None], blocks].long()
        return self.step.fmt.widen(layer, self.step.kv[layer][table, 0, rows, 0])

    def count(self, name: str, values: torch.Tensor, valid: torch.Tensor) -> None:
        """What a CSA layer read, in ``kvstore.sparse_reads``' counters (every block here is on the device)."""
        reads = self.meta.sparse_reads
        if reads is None or not self.places.counted:
            return
        size = int(valid.sum()) * values.shape[-1] * self.step.kv[self.places.entry_layer(name)].element_size()
        if name == "indexer":
            reads.reads += len(self.seqs)
            reads.index_key_bytes_device += size
        else:
            reads.latent_bytes_device += size

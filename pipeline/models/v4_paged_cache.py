"""One sequence's DeepSeek-V4 caches of one layer, read and written in the paged KV store.

``attention_v4.V4Attention`` asks by absolute position; this answers from the layer's KV-layout layers
(``models.cache_groups.compressed_groups``): its sliding window of K=V and its compressor's per-token
projections live in window groups (only the blocks inside their window are on the device, in the group's own
slots: ``meta.for_layer``), its pooled entries (and on CSA its indexer keys) in compressed groups of the
sequence's own blocks, entry ``w`` in the block that holds token ``(w + 1) m - 1``. Of blocks spilled to the host
or disk tier, what every step reads whole (indexer keys, HCA entries) comes from the device's copies of them
(``kvstore.layer_mirror``) while they fit; the CSA entries a step chose are loaded, only the blocks that hold them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels import AttentionMetadata
from strata.kernels.cache_ops import FP8_MAX
from strata.pipeline.models.compressed_attention_config import CompressedAttentionConfig


@dataclass(frozen=True)
class V4CacheFormat:
    """How the caches hold values: in ``dtype`` (the model's), or in an FP8 cache as e4m3 over the scale of their
    KV-layout layer (``scales``: one per layer, powers of two from ``models.kv_scales``), widened on read. The
    window's K=V, the projections and the entries share one softmax or pool with values of other layers, so
    reads widen here rather than folding scales into queries as the other attentions do."""

    dtype: torch.dtype
    scales: tuple[float, ...] | None = None

    def store(self, layer: int, values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
        if self.scales is None:
            return values.to(cache_dtype)
        return (values.float() / self.scales[layer]).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)

    def widen(self, layer: int, stored: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            return stored.to(self.dtype)
        return (stored.float() * self.scales[layer]).to(self.dtype)


class PagedV4Cache:
    """Sequence ``seq`` of the step, model layer ``layer``: the :class:`attention_v4.V4Cache` calls (the step's
    writes are ``v4_paged_step``'s)."""

    def __init__(self, kv: list[torch.Tensor], meta: AttentionMetadata, seq: int, layer: int,
                 cfg: CompressedAttentionConfig, fmt: V4CacheFormat) -> None:
        self.kv, self.meta, self.seq, self.layer, self.fmt = kv, meta, seq, layer, fmt
        rate = cfg.compress[layer]
        self.rate = rate
        self._projection: dict[str, tuple[int, int, int]] = {}
        if rate:
            self.projection_layer = cfg.projection_layer(layer)
            d, i = cfg.head_dim, cfg.index_dim
            self.sparse = cfg.sparse[layer]
            # where each name's (value, gate) sit in the layer's per-token vectors, and its entries' layer
            self._projection = ({"compressor": (0, 2 * d, 4 * d), "indexer": (4 * d, 4 * d + 2 * i, 4 * d + 4 * i)}
                                if self.sparse else {"compressor": (0, d, 2 * d)})
            self._entries = {"compressor": cfg.entry_layer(layer)}
            if self.sparse:
                self._entries["indexer"] = cfg.index_layer(layer)

    def _read(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Positions start..end-1 of a window group's layer [n, width]: they must be inside its window."""
        m = self.meta.for_layer(layer)
        offset, bs = m.kv_offset(self.seq), m.block_size
        if start < offset:
            raise RuntimeError(f"position {start} is before the window kept on the device (from {offset})")
        positions = torch.arange(start, end, device=m.block_tables.device)
        blocks = m.block_tables[self.seq, torch.div(positions - offset, bs, rounding_mode="floor")].long()
        return self.fmt.widen(layer, self.kv[layer][blocks, 0, positions % bs, 0])

    def read_kv(self, start: int, end: int) -> torch.Tensor:
        return self._read(self.layer, start, end)

    def read_projections(self, name: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, mid, hi = self._projection[name]
        values = self._read(self.projection_layer, start, end)
        return values[:, lo:mid], values[:, mid:hi]

    def projection_columns(self, name: str) -> tuple[int, int, int]:
        """Where ``name``'s value and gate sit in the layer's per-token vectors: (start, split, end)."""
        return self._projection[name]

    def entry_layer(self, name: str) -> int:
        """The KV-layout layer that holds ``name``'s entries."""
        return self._entries[name]

    def entry_places(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block position in the sequence, row in the block) of entries ``ids``."""
        bs, m = self.meta.block_size, self.rate
        closing = (ids + 1) * m - 1  # the token that closes each entry's window
        rows = torch.div(closing % bs, m, rounding_mode="floor") if bs >= m else torch.zeros_like(closing)
        return torch.div(closing, bs, rounding_mode="floor"), rows

    def write_entries(self, name: str, first: int, entries: torch.Tensor) -> None:
        blocks, rows = self.entry_places(torch.arange(first, first + entries.shape[0], device=entries.device))
        resident = self.meta.kv_offset(self.seq) // self.meta.block_size
        ids = self.meta.block_tables[self.seq, blocks - resident].long()
        layer = self._entries[name]
        self.kv[layer][ids, 0, rows, 0] = self.fmt.store(layer, entries, self.kv[layer].dtype)

    def read_entries(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Entries ``ids`` [n, width]: from the device blocks; of spilled blocks, from the device's copy when every
        step reads the layer whole (indexer keys, HCA entries), else loaded a run of blocks at a time, only those
        holding one of them. A CSA layer's reads are counted (``kvstore.sparse_reads``)."""
        layer = self._entries[name]
        blocks, rows = self.entry_places(ids)
        cache = self.kv[layer]
        resident = self.meta.kv_offset(self.seq) // self.meta.block_size
        out = torch.empty((len(ids), cache.shape[-1]), dtype=self.fmt.dtype, device=cache.device)
        on_device = blocks >= resident
        table = self.meta.block_tables[self.seq, blocks[on_device] - resident].long()
        out[on_device] = self.fmt.widen(layer, cache[table, 0, rows[on_device], 0])
        loaded, kept = 0, 0
        if not bool(on_device.all()):
            source = self.meta.spilled[self.seq] if self.meta.spilled is not None else None
            if source is None:
                raise RuntimeError("entries before the device blocks, but no spilled source for them")
            spilled = ~on_device
            if self.meta.layer_mirror is not None and (name == "indexer" or not self.sparse):
                copy, loaded = self.meta.layer_mirror.tokens(source, layer, resident)  # [resident * rows, 1, width]
                out[spilled] = self.fmt.widen(layer, copy[blocks[spilled] * cache.shape[2] + rows[spilled], 0])
                kept = copy.numel() * copy.element_size() - loaded
            else:
                loaded = self._load(source, layer, out, blocks, rows, spilled)
        if self.counted:
            device = int(on_device.sum()) * out.shape[-1] * cache.element_size() + kept
            self._count(name, device, loaded, resident, blocks)
        return out

    @property
    def counted(self) -> bool:
        return self.meta.sparse_reads is not None and self.rate > 0 and self.sparse

    def _count(self, name: str, device_bytes: int, loaded: int, resident: int, blocks: torch.Tensor) -> None:
        reads = self.meta.sparse_reads
        if name == "indexer":  # every key of the context: one selection
            reads.reads += 1
            reads.index_key_bytes_device += device_bytes
            reads.index_key_bytes_spilled += loaded
            return
        reads.latent_bytes_device += device_bytes
        reads.latent_bytes_spilled += loaded
        reads.spilled_blocks_seen += resident
        reads.spilled_blocks_read += len(torch.unique(blocks[blocks < resident]))

    def _load(self, source: object, layer: int, out: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor,
              spilled: torch.Tensor) -> int:
        """Entries in blocks below the device, loaded a run of blocks at a time (``kernels.SpilledKV``); returns the
        bytes loaded."""
        wanted, i, loaded = torch.unique(blocks[spilled]).tolist(), 0, 0
        while i < len(wanted):  # runs of consecutive blocks, a staging buffer's worth at a time
            first, n = wanted[i], 1
            while i + n < len(wanted) and wanted[i + n] == first + n and n < source.segment_blocks:
                n += 1
            k, _ = source.load(layer, first, n)
            here = spilled & (blocks >= first) & (blocks < first + n)
            out[here] = self.fmt.widen(layer, k[blocks[here] - first, rows[here], 0])
            loaded += k.numel() * k.element_size()
            i += n
        return loaded

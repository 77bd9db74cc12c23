"""Turns a scheduled step into one forward pass of the language model over the paged cache."""

from __future__ import annotations

import torch

from strata.kernels import AttentionBackend, AttentionMetadata
from strata.kvstore import TieredKVCache
from strata.pipeline.models.decoder import LanguageModel
from strata.pipeline.scheduler import ScheduledChunk


class ModelRunner:
    """Flattens every chunk of the step into one batch, overlays image embeddings, and returns
    the logits of the chunks that end on their sequence's last known token."""

    def __init__(self, model: LanguageModel, kv: TieredKVCache, backend: AttentionBackend, device: str = "cpu") -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = torch.device(device)
        self.block_size = kv.layout.block_size

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [num sampling chunks, vocab] (fp32), in the order those chunks appear."""
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        for chunk in chunks:
            seq = chunk.seq
            token_ids.extend(seq.token_ids[chunk.start : chunk.end])
            positions.extend(range(chunk.start, chunk.end))
            slots.extend(seq.block_table.slots(chunk.start, chunk.end))
            if chunk.samples:
                last_rows.append(len(token_ids) - 1)
        meta = AttentionMetadata.build(
            query_lens=[c.num_tokens for c in chunks],
            seq_lens=[c.end for c in chunks],
            block_tables=[c.seq.block_table.block_ids for c in chunks],
            slot_mapping=slots,
            block_size=self.block_size,
            device=self.device,
            kv_offsets=[c.seq.block_table.first_resident_token for c in chunks],
            spilled=[self.kv.spilled(c.seq.block_table) for c in chunks],
        )
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        embeds = self.model.embed(ids)
        self._overlay_images(embeds, chunks)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(embeds, pos, self.kv.device_kv, meta, self.backend)
        rows = torch.tensor(last_rows, dtype=torch.int64, device=self.device)
        return self.model.logits(hidden[rows])

    @staticmethod
    def _overlay_images(embeds: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
        """Replace placeholder-token embeddings with the image embeddings covering those positions."""
        row = 0
        for chunk in chunks:
            for img in chunk.seq.images:
                lo, hi = max(img.offset, chunk.start), min(img.offset + img.length, chunk.end)
                if lo < hi:
                    src = torch.from_numpy(img.embeds[lo - img.offset : hi - img.offset])
                    embeds[row + lo - chunk.start : row + hi - chunk.start] = src.to(embeds.dtype)
            row += chunk.num_tokens

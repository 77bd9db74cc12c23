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
        self.compile_seconds = 0.0  # set when the model's dense steps were compiled (EngineConfig.compile)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [num sampling chunks, vocab] (fp32), in the order those chunks appear.

        One pass over the chunks gathers everything the step needs (O(sequences) Python work, plus
        the tokens of prefill chunks); the metadata is built once and read by every layer.
        """
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        offsets: list[int] = []
        spilled = []
        bs = self.block_size
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.end
            table = seq.block_table
            if end - start == 1:  # a decode: one token, one slot
                token_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table.block_ids[start // bs - table.num_spilled] * bs + start % bs)
            else:
                token_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table.slots(start, end))
            if end == seq.num_tokens:
                last_rows.append(len(token_ids) - 1)
            query_lens.append(end - start)
            seq_lens.append(end)
            tables.append(table.block_ids)
            offsets.append(table.first_resident_token)
            spilled.append(self.kv.spilled(table) if table.num_spilled else None)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, bs, self.device, offsets, spilled)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        embeds = self.model.embed(ids)
        self._overlay_images(embeds, chunks)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model.forward(embeds, pos, self.kv.device_kv, meta, self.backend)
        if len(last_rows) != len(token_ids):  # keep only the rows whose logits are sampled
            hidden = hidden[torch.tensor(last_rows, dtype=torch.int64, device=self.device)]
        return self.model.logits(hidden)

    @staticmethod
    def _overlay_images(embeds: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
        """Replace placeholder-token embeddings with the image embeddings covering those positions."""
        row = 0
        for chunk in chunks:
            if not chunk.seq.images:
                row += chunk.num_tokens
                continue
            for img in chunk.seq.images:
                lo, hi = max(img.offset, chunk.start), min(img.offset + img.length, chunk.end)
                if lo < hi:
                    src = torch.from_numpy(img.embeds[lo - img.offset : hi - img.offset])
                    embeds[row + lo - chunk.start : row + hi - chunk.start] = src.to(embeds.device, embeds.dtype)
            row += chunk.num_tokens

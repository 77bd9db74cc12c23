"""Turns a scheduled step into one forward pass of the language model over the paged cache.

Two halves: :meth:`ModelRunner.prepare` reads the scheduler's chunks into plain :class:`StepInputs`
(what a tensor-parallel driver broadcasts to its workers), and :class:`StepExecutor` runs the model
on those inputs over one process's KV tensor (what every rank runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from strata.kernels import AttentionBackend, AttentionMetadata, SpilledKV
from strata.kvstore import BlockTable, TieredKVCache
from strata.kvstore.layer_mirror import SpilledLayerMirror
from strata.kvstore.sparse_reads import SparseReads
from strata.kvstore.state_pool import StatePool
from strata.pipeline.core.prompt_logprobs import wants_prompt_rows
from strata.pipeline.core.scheduler import ScheduledChunk
from strata.pipeline.models.decoder import LanguageModel
from strata.pipeline.models.linear_mixer import LinearStates
from strata.pipeline.models.mrope import MRopeLayout


@dataclass
class WindowInputs:
    """One sliding-window group's view of the step: each sequence's blocks from its window's start, as
    that group's slots (``kvstore.window_claims``), and the slots this step's tokens write."""

    tables: list[list[int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


@dataclass
class StepInputs:
    """One step's batch as plain lists: everything a rank needs besides its model and KV tensor."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    last_rows: list[int] = field(default_factory=list)  # rows whose logits are sampled
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    num_spilled: list[int] = field(default_factory=list)  # spilled blocks per sequence
    images: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (first row, embeddings) overlays
    deepstack: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (first row, [levels, n, hidden]) additions
    mrope_positions: np.ndarray | None = None  # int64 [3, T] under M-RoPE (then ``positions`` is unused)
    windows: list[WindowInputs] = field(default_factory=list)  # per sliding-window group (``KVLayout.window_groups``)
    state_slots: list[int] = field(default_factory=list)  # per sequence: the linear-attention state it reads
    state_writes: list[int] = field(default_factory=list)  # ... and the slot its new state goes to
    # per sequence: (row, slot) its state at a block boundary is copied to after that many of its rows; -1: none
    state_snapshots: list[tuple[int, int]] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)  # per sequence (DSA's top-k rule reads it)
    state_ops: list[tuple] = field(default_factory=list)  # tensor parallel: the driver's state changes since
    # the last step, which a worker replays before its forward (``core.tp_states``)


class StepExecutor:
    """Runs :class:`StepInputs` through a model over one KV tensor; returns the sampled rows' logits
    (None on a tensor-parallel worker, whose logits are gathered to the driver)."""

    def __init__(self, model: LanguageModel, device_kv: list[torch.Tensor], backend: AttentionBackend, block_size: int,
                 device: str = "cpu", layer_meta: tuple[int, ...] = (), states: StatePool | None = None,
                 sparse_reads: SparseReads | None = None, layer_mirror: SpilledLayerMirror | None = None) -> None:
        """``layer_meta``: which metadata each layer reads (``KVLayout.layer_meta``; empty: one for all);
        ``states``: the linear-attention layers' per-sequence state, if the model has such layers;
        ``sparse_reads`` and ``layer_mirror``: where sparse attention counts its reads and keeps its indexer keys'
        spilled blocks on the device, if the model has it."""
        self.model = model
        self.states = states
        self.sparse_reads, self.layer_mirror = sparse_reads, layer_mirror
        self.layer_meta = layer_meta
        self.device_kv = device_kv
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.keep_hidden = False  # keep every row's final hidden state (the MTP drafter reads them)
        self.hidden: torch.Tensor | None = None

    def metadata(self, inputs: StepInputs, spilled: list[SpilledKV | None]) -> AttentionMetadata:
        """The step's attention metadata, with each sliding-window group's own for its layers."""
        meta = AttentionMetadata.build(inputs.query_lens, inputs.seq_lens, inputs.tables, inputs.slots,
                                       self.block_size, self.device, inputs.offsets, spilled)
        if inputs.windows:
            metas = [meta, *(AttentionMetadata.build(inputs.query_lens, inputs.seq_lens, w.tables, w.slots,
                                                     self.block_size, self.device, w.offsets)
                             for w in inputs.windows)]
            meta.by_layer = tuple(metas[i] for i in self.layer_meta)
        meta.prompt_lens, meta.sparse_reads, meta.layer_mirror = inputs.prompt_lens, self.sparse_reads, self.layer_mirror
        if self.states is not None:
            meta.states = LinearStates(self.states, inputs.state_slots, inputs.state_writes, inputs.query_lens,
                                       inputs.state_snapshots)
        return meta

    @torch.inference_mode()
    def run(self, inputs: StepInputs, spilled: list[SpilledKV | None]) -> torch.Tensor | None:
        meta = self.metadata(inputs, spilled)
        ids = torch.tensor(inputs.token_ids, dtype=torch.int64, device=self.device)
        meta.token_ids = ids
        embeds = self.model.embed(ids)
        for row, image in inputs.images:
            embeds[row : row + len(image)] = torch.from_numpy(image).to(embeds.device, embeds.dtype)
        deepstack = _deepstack(inputs.deepstack, self.device) if inputs.deepstack else None
        if inputs.mrope_positions is not None:
            pos = torch.from_numpy(inputs.mrope_positions).to(self.device)
        else:
            pos = torch.tensor(inputs.positions, dtype=torch.int64, device=self.device)
        hidden = self.model.forward(embeds, pos, self.device_kv, meta, self.backend, deepstack)
        if self.keep_hidden:
            self.hidden = hidden
        if len(inputs.last_rows) != len(inputs.token_ids):  # keep only the rows whose logits are sampled
            hidden = hidden[torch.tensor(inputs.last_rows, dtype=torch.int64, device=self.device)]
        return self.model.logits(hidden)


class ModelRunner:
    """Flattens every chunk of the step into one batch, overlays image embeddings, and returns
    the logits of the chunks that end on their sequence's last known token."""

    def __init__(self, model: LanguageModel, kv: TieredKVCache, backend: AttentionBackend, device: str = "cpu") -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = torch.device(device)
        self.block_size = kv.layout.block_size
        self.executor = StepExecutor(model, kv.device_kv, backend, self.block_size, device, kv.layout.layer_meta,
                                     kv.states.pool if kv.states is not None else None, kv.sparse_reads,
                                     kv.layer_mirror)
        self.windows = [(gi, kv.pool.windows[gi]) for gi in kv.layout.window_groups]
        self.compile_seconds = 0.0  # set when the model's dense steps were compiled (EngineConfig.compile)
        self.mrope = model.cfg.uses_mrope

    @property
    def tp_size(self) -> int:
        """Processes that run each step (1 here; a tensor-parallel group's size for its driver)."""
        return 1

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [sampled rows, vocab] (fp32), in the order the chunks appear: one row per sampling chunk,
        1 + len(draft) for a chunk verifying a draft, every row of a chunk whose prompt rows are scored
        (``core.prompt_logprobs.logits_rows``)."""
        inputs = self.prepare(chunks)
        spilled = [self.spilled_source(c.seq.block_table) if n else None for c, n in zip(chunks, inputs.num_spilled)]
        return self._run(chunks, inputs, spilled)

    def _run(self, chunks: list[ScheduledChunk], inputs: StepInputs, spilled: list[SpilledKV | None]) -> torch.Tensor:
        """This process's forward of the step, and its linear-attention states kept only if it succeeded."""
        try:
            logits = self.executor.run(inputs, spilled)
        except BaseException:
            if self.kv.states is not None:  # the states read are intact; a snapshot may be half-written
                for chunk in chunks:
                    self.kv.states.drop_snapshot(chunk.seq.block_table)
            raise
        assert logits is not None
        if self.kv.states is not None:
            self._keep_states(chunks, inputs.state_snapshots)
        return logits

    def _keep_states(self, chunks: list[ScheduledChunk], snapshots: list[tuple[int, int]]) -> None:
        """After a step that succeeded: the states it wrote are current, and a snapshot at a boundary its last
        row ended on is their copy."""
        states = self.kv.states
        assert states is not None
        for chunk, (at, snap) in zip(chunks, snapshots):
            table = chunk.seq.block_table
            states.swap(table)
            if at == chunk.end - chunk.start:
                states.pool.copy(table.state_slot, snap)

    @torch.inference_mode()
    def draft(self, inputs: StepInputs, hidden: torch.Tensor, tables: list[BlockTable]) -> torch.Tensor:
        """The MTP layer over ``inputs`` (next tokens at the rows' positions; ``tables`` their sequences') and
        their final hidden states: writes its KV, returns its normed output (``LanguageModel.draft``)."""
        spilled = [self.spilled_source(t) if n else None for t, n in zip(tables, inputs.num_spilled)]
        meta = self.executor.metadata(inputs, spilled)
        ids = torch.tensor(inputs.token_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(inputs.positions, dtype=torch.int64, device=self.device)
        return self.model.draft(ids, hidden, pos, self.kv.device_kv, meta, self.backend)

    def _snapshot_at(self, chunk: ScheduledChunk) -> tuple[int, int]:
        """(rows into the chunk, slot) where its sequence's state at the last block boundary the chunk reaches
        is kept (``kvstore.state_cache``); (-1, -1): none (no boundary crossed, or no slot to be had)."""
        bs, end = self.block_size, chunk.end - len(chunk.draft)
        boundary = end // bs * bs
        if boundary <= chunk.start or boundary == 0:
            return -1, -1
        slot = self.kv.states.take(chunk.seq.block_table, boundary // bs)  # type: ignore[union-attr]
        return (-1, -1) if slot is None else (boundary - chunk.start, slot)

    def spilled_source(self, table: BlockTable) -> SpilledKV | None:
        return self.kv.spilled(table)

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """One pass over the chunks gathers everything the step needs (O(sequences) Python work, plus
        the tokens of prefill chunks)."""
        s = StepInputs()
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.end
            table = seq.block_table
            if seq.images:
                _add_images(s.images, s.deepstack, chunk, len(s.token_ids))
            if end - start == 1:  # a decode: one token, one slot
                s.token_ids.append(seq.token_ids[start])
                s.positions.append(start)
                s.slots.append(table.slot(start))
            else:  # a prefill chunk, or a decode with its draft: every row of the draft is sampled
                s.token_ids.extend(seq.token_ids[start : end - len(chunk.draft)])
                s.token_ids.extend(chunk.draft)
                s.positions.extend(range(start, end))
                s.slots.extend(table.slots(start, end))
            if chunk.draft:
                s.last_rows.extend(range(len(s.token_ids) - len(chunk.draft) - 1, len(s.token_ids)))
            elif wants_prompt_rows(chunk):  # every row scores a prompt token (``core.prompt_logprobs``)
                s.last_rows.extend(range(len(s.token_ids) - (end - start), len(s.token_ids)))
            elif end == seq.num_tokens:
                s.last_rows.append(len(s.token_ids) - 1)
            s.query_lens.append(end - start)
            s.seq_lens.append(end)
            s.tables.append(table.block_ids)
            s.offsets.append(table.first_resident_token)
            s.num_spilled.append(table.num_spilled)
            s.prompt_lens.append(seq.num_prompt_tokens)
            if self.kv.states is not None:
                s.state_slots.append(table.state_slot)
                s.state_writes.append(table.state_spare)
                s.state_snapshots.append(self._snapshot_at(chunk))
        if self.windows:
            s.windows = [_window_inputs(chunks, gi, w.slot) for gi, w in self.windows]
        if self.mrope:
            s.mrope_positions = _mrope_positions(chunks)
        return s


def _window_inputs(chunks: list[ScheduledChunk], group: int, slot_of: list[int]) -> WindowInputs:
    """A sliding-window group's tables and write slots for the step: the blocks from each table's window
    start, mapped to the slots that group lent them."""
    w = WindowInputs()
    for chunk in chunks:
        table = chunk.seq.block_table
        bs, skip, start = table.block_size, table.num_spilled, table.window_starts[group]
        w.tables.append([slot_of[b] for b in table.block_ids[start - skip :]])
        w.offsets.append(start * bs)
        w.slots.extend(slot_of[table.block_ids[p // bs - skip]] * bs + p % bs for p in range(chunk.start, chunk.end))
    return w


def _mrope_positions(chunks: list[ScheduledChunk]) -> np.ndarray:
    """[3, T] positions of the step's tokens in order; a sequence's layout is built once, where it runs."""
    parts = []
    for chunk in chunks:
        seq = chunk.seq
        if seq.mrope_layout is None:
            if any(img.grid_thw is None for img in seq.images):
                raise ValueError("an image reached an M-RoPE model without its patch grid")
            seq.mrope_layout = MRopeLayout((img.offset, img.length, img.grid_thw) for img in seq.images)  # type: ignore[misc]
        parts.append(seq.mrope_layout.positions(chunk.start, chunk.end))
    return np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), dtype=np.int64)


def _add_images(out: list[tuple[int, np.ndarray]], deepstack: list[tuple[int, np.ndarray]], chunk: ScheduledChunk,
                first_row: int) -> None:
    """The image embeddings covering the chunk's positions, as overlays of its placeholder rows (and their
    DeepStack features, as additions to the same rows)."""
    for img in chunk.seq.images:
        lo, hi = max(img.offset, chunk.start), min(img.offset + img.length, chunk.end)
        if lo < hi:
            row = first_row + lo - chunk.start
            out.append((row, img.embeds[lo - img.offset : hi - img.offset]))
            if img.deepstack is not None:
                deepstack.append((row, img.deepstack[:, lo - img.offset : hi - img.offset]))


def _deepstack(parts: list[tuple[int, np.ndarray]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R], features [levels, R, hidden]) of the step's image tokens, for the decoder to add."""
    rows = np.concatenate([np.arange(row, row + part.shape[1]) for row, part in parts])
    feats = np.concatenate([part for _, part in parts], axis=1)
    return torch.from_numpy(rows).to(device), torch.from_numpy(feats).to(device)

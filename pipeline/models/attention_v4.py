"""DeepSeek-V4's attention: shared-KV MQA over a sliding window plus compressed entries, with sinks.

Every layer projects queries through a LoRA (``q_a_proj``, an fp32-weighted norm, ``q_b_proj``, a weightless
norm per head) and one KV vector per token that serves as key and value (``kv_proj``, ``kv_norm``); both rotate
their trailing ``rope_dim`` dims in interleaved pairs. A query attends over the last ``sliding_window`` tokens,
and on a compressed layer also over pooled entries of the past (``kernels.compress_kv``): every entry whose
window closed at or before it on a heavily compressed (HCA) layer, the top ``index_topk`` its lightning
indexer scores on a compressed sparse (CSA) layer. One softmax spans both with a learned sink per head. The
output's rope dims are rotated back by the query's position (the values carried their keys' rotation), and
a grouped low-rank projection (``o_a_proj`` per group of heads, then ``o_b_proj``) returns to the hidden size.

What a layer keeps per sequence (the window's KV, the compressor's per-token projections, from which an entry
is pooled when its window's last token arrives, from that window and, on CSA, the one before it, and the
entries) is written for the whole step at once through :class:`V4StepCache`, and read a sequence at a time
(:class:`V4Cache`) or, for a decode step's one-row sequences, as padded batches (:class:`V4DecodeReads`).
Parameters keep the release's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import linear
from strata.kernels.compress_kv import (pool_each_window, pool_windows, rms_norm_fp32_weight, rms_norm_unweighted,
                                       rope_tail, tail_rope_cos_sin)
from strata.kernels.quant_weight import QuantWeight


DECODE_BATCH_VALUES = 1 << 24  # values a decode batch's padded entry reads may hold (64 MiB in fp32)


@dataclass(frozen=True)
class V4Geometry:
    """One DeepSeek-V4 attention layer's shape, from its config."""

    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress: int  # tokens per entry: 0 (sliding only), 4 (CSA) or 128 (HCA)
    index_heads: int
    index_dim: int
    index_topk: int
    eps: float

    @property
    def sparse(self) -> bool:
        """CSA: entries pooled over two windows and chosen by the indexer."""
        return self.compress > 0 and self.index_topk > 0 and self.index_heads > 0


class V4Cache(Protocol):
    """One sequence's caches of one layer, by absolute token position (``entries``: by entry index)."""

    def read_kv(self, start: int, end: int) -> torch.Tensor: ...
    def read_projections(self, name: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def write_entries(self, name: str, first: int, entries: torch.Tensor) -> None: ...
    def read_entries(self, name: str, ids: torch.Tensor) -> torch.Tensor: ...


class V4DecodeReads(Protocol):
    """Sequences of one new row each, read together: [B, ...] tensors padded to the longest, with which exist."""

    def window(self, size: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def entries(self, name: str, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def entries_at(self, name: str, ids: torch.Tensor) -> torch.Tensor: ...
    def count(self, name: str, values: torch.Tensor, valid: torch.Tensor) -> None: ...


class V4StepCache(Protocol):
    """Every sequence's caches of one layer in a step: the rows' writes at once, the reads per sequence or, for
    one-row sequences it can read together (``batchable``), in one decode batch."""

    def write_kv(self, kv: torch.Tensor) -> None: ...
    def write_projections(self, name: str, kv: torch.Tensor, gate: torch.Tensor) -> None: ...
    def sequence(self, i: int) -> V4Cache: ...
    def batchable(self, i: int) -> bool: ...
    def decode_batch(self, seqs: list[int]) -> V4DecodeReads: ...


@dataclass(frozen=True)
class V4Span:
    """One sequence's rows in a step: ``rows`` rows at positions ``first ..`` of a ``prompt_len``-token prompt
    (0: every row generated)."""

    first: int
    rows: int
    prompt_len: int = 0


class NormWeight(nn.Module):
    """A norm's weight, held in fp32 as the reference holds it."""

    keep_fp32 = True

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))


class Pooler(nn.Module):
    """A compressor's parameters (or its indexer's): per-token value and gate projections, the position bias,
    the entry norm."""

    def __init__(self, hidden: int, dim: int, compress: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = dim * (2 if overlap else 1)
        self.overlap, self.dim, self.compress, self.eps = overlap, dim, compress, eps
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(compress, width))
        self.kv_norm = NormWeight(dim)
        self.keep_fp32 = True  # the position bias, as the reference keeps it

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's value and gate projections, for the whole step at once."""
        return linear(h, self.kv_proj.weight), linear(h, self.gate_proj.weight)

    def pool(self, name: str, first: int, end: int, cache: V4Cache, inv_freq: torch.Tensor, scaling: float) -> int:
        """Pools every window that one sequence's rows ``first .. end - 1`` (their projections already written)
        close into an entry; returns the entries there are now."""
        m = self.compress
        done, closed = first // m, end // m
        if closed > done:
            lo = (done - 1) * m if (self.overlap and done) else done * m
            kv, gate = cache.read_projections(name, lo, closed * m)
            prior = None
            if lo < done * m:
                prior, kv, gate = (kv[:m], gate[:m]), kv[m:], gate[m:]
            width = kv.shape[-1]
            pooled = pool_windows(kv.view(-1, m, width), gate.view(-1, m, width), self.position_bias, self.overlap,
                                  *(prior or (None, None)))
            normed = rms_norm_fp32_weight(pooled, self.kv_norm.weight, self.eps)
            cos, sin = tail_rope_cos_sin(inv_freq, scaling, torch.arange(done, closed, device=kv.device) * m,
                                         normed.dtype)
            cache.write_entries(name, done, rope_tail(normed, cos, sin))
        return closed

    def pool_closing(self, name: str, firsts: list[int], caches: list[V4Cache], inv_freq: torch.Tensor,
                     scaling: float) -> None:
        """Sequences whose one new row (at ``firsts[j]``, its projections written) closes a window: those windows
        pooled together, an entry each, exactly as :meth:`pool` pools each alone."""
        m = self.compress
        done = [first // m for first in firsts]
        current, prior = [], []
        for d, cache in zip(done, caches):
            kv, gate = cache.read_projections(name, (d - 1) * m if (self.overlap and d) else d * m, (d + 1) * m)
            current.append((kv[-m:], gate[-m:]))
            prior.append((kv[:m], gate[:m]) if len(kv) > m else (torch.zeros_like(kv), torch.zeros_like(gate)))
        kv, gate = (torch.stack(t) for t in zip(*current))
        prior_kv, prior_gate = (torch.stack(t) for t in zip(*prior))
        has_prior = torch.tensor([self.overlap and d > 0 for d in done], device=kv.device)
        pooled = pool_each_window(kv, gate, self.position_bias, self.overlap, prior_kv, prior_gate, has_prior)
        normed = rms_norm_fp32_weight(pooled, self.kv_norm.weight, self.eps)
        cos, sin = tail_rope_cos_sin(inv_freq, scaling, torch.tensor(done, device=kv.device) * m, normed.dtype)
        entries = rope_tail(normed, cos, sin)
        for j, (d, cache) in enumerate(zip(done, caches)):
            cache.write_entries(name, d, entries[j : j + 1])


class Indexer(Pooler):
    """CSA's lightning indexer: its own pooled keys, and query heads from the q LoRA weighted per head."""

    def __init__(self, g: V4Geometry) -> None:
        super().__init__(g.hidden, g.index_dim, g.compress, True, g.eps)
        self.heads, self.topk = g.index_heads, g.index_topk
        self.q_b_proj = nn.Linear(g.q_lora_rank, g.index_heads * g.index_dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(g.hidden, g.index_heads, bias=False)

    def queries(self, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's index queries [rows, heads, dim] (rotated) and their per-head weights [rows, heads] fp32."""
        q = linear(q_resid, self.q_b_proj.weight).view(h.shape[0], self.heads, self.dim)
        return rope_tail(q, cos, sin), linear(h, self.scorer.weights_proj.weight).float() * self.heads**-0.5

    def choose(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               prompt_len: int | torch.Tensor) -> torch.Tensor:
        """Per row (``queries``' rows), the entries it attends: int64 [rows, k], -1 where it sees fewer than k.
        ``keys`` are one sequence's [E, dim], or each row's own [rows, E, dim] (a decode batch, padded: entries a
        row may not see are never chosen); ``prompt_len`` is the sequence's, or each row's.

        transformers picks a prompt's rows in one forward, over every entry the prompt closes (later ones at
        -inf), and a generated row's over the entries closed up to it; torch's top-k breaks ties by that width,
        so each row scores as many entries as transformers' does, the ones it may not see at -inf."""
        scores = F.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2))) * self.dim**-0.5  # [rows, heads, E]
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)
        visible = (positions + 1) // self.compress
        widths = torch.maximum(visible, torch.as_tensor(prompt_len, device=q.device) // self.compress)
        k = min(self.topk, int(widths.max()))
        chosen = torch.full((q.shape[0], k), -1, dtype=torch.int64, device=q.device)
        for width in torch.unique(widths).tolist():
            rows = torch.nonzero(widths == width).flatten()
            padded = F.pad(scores[rows], (0, max(0, width - keys.shape[-2])), value=float("-inf"))[:, :width]
            hidden = torch.arange(width, device=q.device)[None, :] >= visible[rows, None]
            padded = padded.masked_fill(hidden, float("-inf"))
            picked = padded.topk(min(self.topk, width), dim=-1).indices
            chosen[rows, : picked.shape[1]] = torch.where(picked >= visible[rows, None], -1, picked)
        return chosen


class V4Attention(nn.Module):
    """One DeepSeek-V4 attention layer (sliding, CSA or HCA): projections over the whole step, attention a
    sequence at a time or, for a decode step's one-row sequences, in batches."""

    keep_fp32 = True  # its own tensor, the sinks (its projections are modules of their own)

    def __init__(self, g: V4Geometry, main_rope: tuple[torch.Tensor, float],
                 compress_rope: tuple[torch.Tensor, float]) -> None:
        super().__init__()
        self.g = g
        self.rope = compress_rope if g.compress else main_rope  # a compressed layer rotates as its entries do
        self.compress_rope = compress_rope
        self.q_a_proj = nn.Linear(g.hidden, g.q_lora_rank, bias=False)
        self.q_a_norm = NormWeight(g.q_lora_rank)
        self.q_b_proj = nn.Linear(g.q_lora_rank, g.heads * g.head_dim, bias=False)
        self.kv_proj = nn.Linear(g.hidden, g.head_dim, bias=False)
        self.kv_norm = NormWeight(g.head_dim)
        self.o_a_proj = nn.Linear(g.heads * g.head_dim // g.o_groups, g.o_groups * g.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(g.o_groups * g.o_lora_rank, g.hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(g.heads))
        if g.compress:
            self.compressor = Pooler(g.hidden, g.head_dim, g.compress, g.sparse, g.eps)
            if g.sparse:
                self.compressor.indexer = Indexer(g)

    def forward(self, h: torch.Tensor, spans: Sequence[V4Span], cache: V4StepCache) -> torch.Tensor:
        """The step's rows h [n, hidden] (normed), sequence after sequence as ``spans`` lay them out: [n, hidden].

        Every projection and cache write runs once over the whole step, so a decode step of many sequences
        reads each weight once; the sequences of one new row attend together over padded reads, the others
        (prefill chunks, contexts with spilled blocks) one by one, in the same step."""
        g, n = self.g, h.shape[0]
        positions = torch.cat([torch.arange(s.first, s.first + s.rows, device=h.device) for s in spans])
        cos, sin = tail_rope_cos_sin(*self.rope, positions, h.dtype)
        q_resid = rms_norm_fp32_weight(linear(h, self.q_a_proj.weight), self.q_a_norm.weight, g.eps)
        q = rms_norm_unweighted(linear(q_resid, self.q_b_proj.weight).view(n, g.heads, g.head_dim), g.eps)
        q = rope_tail(q, cos, sin)
        kv = rope_tail(rms_norm_fp32_weight(linear(h, self.kv_proj.weight), self.kv_norm.weight, g.eps), cos, sin)
        pooled = self._projections(h, q_resid, cos, sin)
        cache.write_kv(kv)
        for name, inputs in pooled.items():
            cache.write_projections(name, *inputs[:2])
        starts = torch.tensor([0] + [s.rows for s in spans]).cumsum(0).tolist()
        decode = [i for i, s in enumerate(spans) if s.rows == 1 and cache.batchable(i)]
        together = set(decode)
        out = torch.empty_like(q)
        for i, s in enumerate(spans):
            if i not in together:
                rows = slice(starts[i], starts[i] + s.rows)
                mine = {name: tuple(t[rows] for t in inputs) for name, inputs in pooled.items()}
                out[rows] = self._attend_one(s, cache.sequence(i), q[rows], positions[rows], mine)
        for batch in self._decode_groups(decode, spans):
            rows = torch.tensor([starts[i] for i in batch], device=h.device)
            mine = {name: tuple(t[rows] for t in inputs) for name, inputs in pooled.items()}
            closing = [cache.sequence(i) if g.compress and (spans[i].first + 1) % g.compress == 0 else None
                       for i in batch]
            out[rows] = self._attend_decode(cache.decode_batch(batch), [spans[i] for i in batch], closing, q[rows],
                                            positions[rows], mine)
        out = rope_tail(out, cos, -sin)
        return linear(self._grouped_output(out.reshape(n, g.o_groups, -1)), self.o_b_proj.weight)

    def _grouped_output(self, grouped: torch.Tensor) -> torch.Tensor:
        """The block-diagonal first output projection: group j's heads [n, j, in] times rows ``j * rank ..``
        of ``o_a_proj``; a quantized weight (V4's FP8 release) is multiplied group by group, in its format."""
        g, n, w = self.g, grouped.shape[0], self.o_a_proj.weight
        if isinstance(w, QuantWeight):
            return torch.cat([linear(grouped[:, j], w.row_range(j * g.o_lora_rank, (j + 1) * g.o_lora_rank))
                              for j in range(g.o_groups)], dim=-1)
        dense = w.view(g.o_groups, -1, grouped.shape[-1]).transpose(1, 2)
        return torch.bmm(grouped.transpose(0, 1), dense).transpose(0, 1).reshape(n, -1)

    def _decode_groups(self, decode: list[int], spans: Sequence[V4Span]) -> list[list[int]]:
        """The one-row sequences in batches whose padded reads stay bounded: a batch pads every row's entries
        (and on CSA its indexer scores, [rows, heads, entries] in fp32) to its longest context's, so at a
        million tokens a batch holds as many rows as ``DECODE_BATCH_VALUES`` allows."""
        g = self.g
        per_entry = (g.index_heads + g.index_dim) if g.sparse else g.head_dim
        groups: list[list[int]] = []
        longest = 0
        for i in decode:
            entries = (spans[i].first + 1) // g.compress if g.compress else 0
            if groups and max(longest, entries) * per_entry * (len(groups[-1]) + 1) <= DECODE_BATCH_VALUES:
                groups[-1].append(i)
                longest = max(longest, entries)
            else:
                groups.append([i])
                longest = entries
        return groups

    def _projections(self, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> dict[str, tuple[torch.Tensor, ...]]:
        """The step's per-row inputs of the compressor (value, gate), and of the indexer (value, gate, query,
        head weights); a compressed layer rotates its queries as its entries, so ``cos``/``sin`` serve both."""
        if not self.g.compress:
            return {}
        out: dict[str, tuple[torch.Tensor, ...]] = {"compressor": self.compressor.project(h)}
        if self.g.sparse:
            indexer = self.compressor.indexer
            out["indexer"] = indexer.project(h) + indexer.queries(h, q_resid, cos, sin)
        return out

    def _attend_one(self, s: V4Span, cache: V4Cache, q: torch.Tensor, positions: torch.Tensor,
                    pooled: dict[str, tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """One sequence's rows: its windows pooled, its window and entries read, attended: [rows, heads, dim]."""
        g = self.g
        lo = max(0, s.first - g.window + 1)
        keys = cache.read_kv(lo, s.first + s.rows)  # every row's window: [lo, its position]
        key_pos = torch.arange(lo, s.first + s.rows, device=q.device)
        allowed = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] > positions[:, None] - g.window)
        if g.compress:
            count = self._pool(cache, s.first, s.first + s.rows)
            if count:
                ids, seen = self._entries_seen(s, cache, pooled, positions, count)
                keys = torch.cat([keys, cache.read_entries("compressor", ids)])
                allowed = torch.cat([allowed, seen], dim=1)
        return _attend_with_sinks(q[None], keys[None], allowed[None], self.sinks, g.head_dim**-0.5)[0]

    def _pool(self, cache: V4Cache, first: int, end: int) -> int:
        """One sequence's windows closed by rows ``first .. end - 1`` pooled (and the indexer's); the entries now."""
        count = self.compressor.pool("compressor", first, end, cache, *self.compress_rope)
        if self.g.sparse:
            self.compressor.indexer.pool("indexer", first, end, cache, *self.compress_rope)
        return count

    def _entries_seen(self, s: V4Span, cache: V4Cache, pooled: dict[str, tuple[torch.Tensor, ...]],
                      positions: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the entries the rows attend, ascending [e]; which row sees which [rows, e]): on HCA every entry whose
        window closed at or before the row; on CSA only those the indexer chose, so only they are read."""
        g, device = self.g, positions.device
        if not g.sparse:
            ids = torch.arange(count, device=device)
            return ids, ids[None, :] < ((positions + 1) // g.compress)[:, None]
        keys = cache.read_entries("indexer", torch.arange(count, device=device))
        chosen = self.compressor.indexer.choose(*pooled["indexer"][2:], keys, positions, s.prompt_len)
        ids = torch.unique(chosen[chosen >= 0])  # ascending: every entry any row chose, read once
        at = torch.searchsorted(ids, chosen.clamp(min=0))
        seen = torch.zeros(len(positions), len(ids) + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, torch.where(chosen >= 0, at, len(ids)), True)
        return ids, seen[:, : len(ids)]

    def _attend_decode(self, reads: V4DecodeReads, spans: list[V4Span], closing: list[V4Cache | None],
                       q: torch.Tensor, positions: torch.Tensor, pooled: dict[str, tuple[torch.Tensor, ...]]
                       ) -> torch.Tensor:
        """Sequences of one new row each, together: the windows their rows close pooled (``closing``: the caches
        of those whose row closes one), each row's window and entries read padded, one batched attention:
        [B, heads, dim]."""
        g = self.g
        keys, allowed = reads.window(g.window)  # [B, window, D]
        closers = [(s.first, cache) for s, cache in zip(spans, closing) if cache is not None]
        if closers:
            firsts, caches = (list(t) for t in zip(*closers))
            self.compressor.pool_closing("compressor", firsts, caches, *self.compress_rope)
            if g.sparse:
                self.compressor.indexer.pool_closing("indexer", firsts, caches, *self.compress_rope)
        if g.compress:
            counts = (positions + 1) // g.compress  # every entry closed at or before each row
            if int(counts.max()):
                if g.sparse:
                    index_keys, exist = reads.entries("indexer", counts)
                    reads.count("indexer", index_keys, exist)
                    prompt_lens = torch.tensor([s.prompt_len for s in spans], device=q.device)
                    chosen = self.compressor.indexer.choose(*pooled["indexer"][2:], index_keys, positions, prompt_lens)
                    seen = chosen >= 0
                    entries = reads.entries_at("compressor", chosen.clamp(min=0))
                    reads.count("compressor", entries, seen)
                else:
                    entries, seen = reads.entries("compressor", counts)
                keys, allowed = torch.cat([keys, entries], dim=1), torch.cat([allowed, seen], dim=1)
        return _attend_with_sinks(q[:, None], keys, allowed[:, None], self.sinks, g.head_dim**-0.5)[:, 0]


def _attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """q [B, n, H, D] over shared key/values [B, K, D] where ``allowed`` [B, n, K], one softmax with a sink logit
    per head (the reference's eager order: logits in q's dtype, the sink joined in fp32, the max subtracted):
    [B, n, H, D]."""
    logits = torch.matmul(q.transpose(1, 2), keys.transpose(1, 2).unsqueeze(1)) * scale  # [B, H, n, K]
    logits = logits.masked_fill(~allowed.unsqueeze(1), torch.finfo(logits.dtype).min)
    b, h, n, _ = logits.shape
    combined = torch.cat([logits, sinks.view(1, -1, 1, 1).expand(b, h, n, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys.unsqueeze(1)).transpose(1, 2)

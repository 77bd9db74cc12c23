"""DeepSeek-V4's attention: shared-KV MQA over a sliding window plus compressed entries, with sinks.

Every layer projects queries through a LoRA (``q_a_proj``, an fp32-weighted norm, ``q_b_proj``, a weightless
norm per head) and one KV vector per token that serves as key and value (``kv_proj``, ``kv_norm``); both rotate
their trailing ``rope_dim`` dims in interleaved pairs. A query attends over the last ``sliding_window`` tokens,
and on a compressed layer also over pooled entries of the past (``kernels.compress_kv``): every entry whose
window closed at or before it on a heavily compressed (HCA) layer, the top ``index_topk`` its lightning
indexer scores on a compressed sparse (CSA) layer. One softmax spans both with a learned sink per head. The
output's rope dims are rotated back by the query's position (the values carried their keys' rotation), and
a grouped low-rank projection (``o_a_proj`` per group of heads, then ``o_b_proj``) returns to the hidden size.

What a layer keeps per sequence is read and written through :class:`V4Cache`: the window's KV, the
compressor's per-token projections (an entry is pooled when its window's last token arrives, from that window
and, on CSA, the one before it) and the entries. Parameters keep the release's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import linear
from strata.kernels.compress_kv import pool_windows, rms_norm_fp32_weight, rms_norm_unweighted, rope_tail, \
    tail_rope_cos_sin


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

    def write_kv(self, first: int, kv: torch.Tensor) -> None: ...
    def read_kv(self, start: int, end: int) -> torch.Tensor: ...
    def write_projections(self, name: str, first: int, kv: torch.Tensor, gate: torch.Tensor) -> None: ...
    def read_projections(self, name: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def write_entries(self, name: str, first: int, entries: torch.Tensor) -> None: ...
    def read_entries(self, name: str, ids: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class V4Span:
    """One sequence's rows in a step: ``rows`` rows at positions ``first ..`` of a ``prompt_len``-token prompt
    (0: every row generated), and that sequence's caches of the layer."""

    first: int
    rows: int
    cache: V4Cache
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

    def step(self, name: str, values: torch.Tensor, gates: torch.Tensor, first: int, cache: V4Cache,
             inv_freq: torch.Tensor, scaling: float) -> int:
        """Writes one sequence's projected rows at ``first ..`` into its cache, pools every window they close into
        an entry; returns the entries there are now."""
        m, end = self.compress, first + values.shape[0]
        cache.write_projections(name, first, values, gates)
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
            cos, sin = tail_rope_cos_sin(inv_freq, scaling, torch.arange(done, closed, device=values.device) * m,
                                         normed.dtype)
            cache.write_entries(name, done, rope_tail(normed, cos, sin))
        return closed


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
               prompt_len: int) -> torch.Tensor:
        """Per row of one sequence (``queries``' rows), the entries it attends: int64 [rows, k], -1 where it sees
        fewer than k.

        transformers picks a prompt's rows in one forward, over every entry the prompt closes (later ones at
        -inf), and a generated row's over the entries closed up to it; torch's top-k breaks ties by that width,
        so each row scores as many entries as transformers' does, the ones it may not see at -inf."""
        scores = F.relu(torch.matmul(q.float(), keys.float().t())) * self.dim**-0.5  # [rows, heads, entries]
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)
        visible = (positions + 1) // self.compress
        widths = torch.clamp(visible, min=prompt_len // self.compress)
        k = min(self.topk, int(widths.max()))
        chosen = torch.full((q.shape[0], k), -1, dtype=torch.int64, device=q.device)
        for width in torch.unique(widths).tolist():
            rows = torch.nonzero(widths == width).flatten()
            padded = F.pad(scores[rows], (0, max(0, width - keys.shape[0])), value=float("-inf"))[:, :width]
            padded = padded.masked_fill(torch.arange(width, device=q.device)[None, :] >= visible[rows, None], float("-inf"))
            picked = padded.topk(min(self.topk, width), dim=-1).indices
            chosen[rows, : picked.shape[1]] = torch.where(picked >= visible[rows, None], -1, picked)
        return chosen


class V4Attention(nn.Module):
    """One DeepSeek-V4 attention layer (sliding, CSA or HCA): projections over the whole step, attention per
    sequence."""

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

    def forward(self, h: torch.Tensor, spans: Sequence[V4Span]) -> torch.Tensor:
        """The step's rows h [n, hidden] (normed), sequence after sequence as ``spans`` lay them out: [n, hidden].

        Every projection runs once over the whole step, so a decode step of many sequences reads each weight
        once; only the cache reads and writes, the pooling and the attention itself go sequence by sequence."""
        g, n = self.g, h.shape[0]
        positions = torch.cat([torch.arange(s.first, s.first + s.rows, device=h.device) for s in spans])
        cos, sin = tail_rope_cos_sin(*self.rope, positions, h.dtype)
        q_resid = rms_norm_fp32_weight(linear(h, self.q_a_proj.weight), self.q_a_norm.weight, g.eps)
        q = rms_norm_unweighted(linear(q_resid, self.q_b_proj.weight).view(n, g.heads, g.head_dim), g.eps)
        q = rope_tail(q, cos, sin)
        kv = rope_tail(rms_norm_fp32_weight(linear(h, self.kv_proj.weight), self.kv_norm.weight, g.eps), cos, sin)
        pooled = self._projections(h, q_resid, cos, sin)
        outs, start = [], 0
        for s in spans:
            rows = slice(start, start + s.rows)
            mine = {name: tuple(t[rows] for t in inputs) for name, inputs in pooled.items()}
            outs.append(self._attend_one(s, q[rows], kv[rows], positions[rows], mine))
            start += s.rows
        out = rope_tail(torch.cat(outs), cos, -sin)
        grouped = out.reshape(n, g.o_groups, -1).transpose(0, 1)  # [groups, n, heads * dim / groups]
        w = self.o_a_proj.weight.view(g.o_groups, -1, grouped.shape[-1]).transpose(1, 2)
        mixed = torch.bmm(grouped, w).transpose(0, 1).reshape(n, -1)
        return linear(mixed, self.o_b_proj.weight)

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

    def _attend_one(self, s: V4Span, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                    pooled: dict[str, tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """One sequence's rows: its caches written, its window and entries read, attended: [rows, heads, dim]."""
        g, cache = self.g, s.cache
        cache.write_kv(s.first, kv)
        lo = max(0, s.first - g.window + 1)
        keys = cache.read_kv(lo, s.first + s.rows)  # every row's window: [lo, its position]
        key_pos = torch.arange(lo, s.first + s.rows, device=q.device)
        allowed = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] > positions[:, None] - g.window)
        if g.compress:
            count = self.compressor.step("compressor", *pooled["compressor"], s.first, cache, *self.compress_rope)
            if g.sparse:
                self.compressor.indexer.step("indexer", *pooled["indexer"][:2], s.first, cache, *self.compress_rope)
            if count:
                ids, seen = self._entries_seen(s, pooled, positions, count)
                keys = torch.cat([keys, cache.read_entries("compressor", ids)])
                allowed = torch.cat([allowed, seen], dim=1)
        return _attend_with_sinks(q, keys, allowed, self.sinks, g.head_dim**-0.5)

    def _entries_seen(self, s: V4Span, pooled: dict[str, tuple[torch.Tensor, ...]], positions: torch.Tensor,
                      count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the entries the rows attend, ascending [e]; which row sees which [rows, e]): on HCA every entry whose
        window closed at or before the row; on CSA only those the indexer chose, so only they are read."""
        g, device = self.g, positions.device
        if not g.sparse:
            ids = torch.arange(count, device=device)
            return ids, ids[None, :] < ((positions + 1) // g.compress)[:, None]
        keys = s.cache.read_entries("indexer", torch.arange(count, device=device))
        chosen = self.compressor.indexer.choose(*pooled["indexer"][2:], keys, positions, s.prompt_len)
        ids = torch.unique(chosen[chosen >= 0])  # ascending: every entry any row chose, read once
        at = torch.searchsorted(ids, chosen.clamp(min=0))
        seen = torch.zeros(len(positions), len(ids) + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, torch.where(chosen >= 0, at, len(ids)), True)
        return ids, seen[:, : len(ids)]


def _attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """q [n, H, D] over shared key/values [K, D] where ``allowed`` [n, K], one softmax with a sink logit per head
    (the reference's eager order: logits in q's dtype, the sink joined in fp32, the max subtracted)."""
    logits = torch.matmul(q.transpose(0, 1), keys.t().unsqueeze(0)) * scale  # [H, n, K]
    logits = logits.masked_fill(~allowed.unsqueeze(0), torch.finfo(logits.dtype).min)
    combined = torch.cat([logits, sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys.unsqueeze(0)).transpose(0, 1)  # [n, H, D]

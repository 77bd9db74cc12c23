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
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

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

    def step(self, name: str, h: torch.Tensor, first: int, cache: V4Cache, inv_freq: torch.Tensor,
             scaling: float) -> int:
        """Projects rows at ``first ..`` into the cache, pools every window they close into an entry; returns the
        entries there are now."""
        m, end = self.compress, first + h.shape[0]
        cache.write_projections(name, first, F.linear(h, self.kv_proj.weight), F.linear(h, self.gate_proj.weight))
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
            cos, sin = tail_rope_cos_sin(inv_freq, scaling, torch.arange(done, closed, device=h.device) * m,
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

    def choose(self, h: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Per row, the entries it attends: int64 [rows, k], -1 where it sees fewer than k.

        transformers picks a prompt's rows in one forward, over every entry the prompt closes (later ones at
        -inf), and a generated row's over the entries closed up to it; torch's top-k breaks ties by that width,
        so each row scores as many entries as transformers' does, the ones it may not see at -inf."""
        q = rope_tail(F.linear(q_resid, self.q_b_proj.weight).view(h.shape[0], self.heads, self.dim), cos, sin)
        scores = F.relu(torch.matmul(q.float(), keys.float().t())) * self.dim**-0.5  # [rows, heads, entries]
        weights = F.linear(h, self.scorer.weights_proj.weight).float() * self.heads**-0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)
        visible = (positions + 1) // self.compress
        widths = torch.clamp(visible, min=prompt_len // self.compress)
        k = min(self.topk, int(widths.max()))
        chosen = torch.full((h.shape[0], k), -1, dtype=torch.int64, device=h.device)
        for width in torch.unique(widths).tolist():
            rows = torch.nonzero(widths == width).flatten()
            padded = F.pad(scores[rows], (0, max(0, width - keys.shape[0])), value=float("-inf"))[:, :width]
            padded = padded.masked_fill(torch.arange(width, device=h.device)[None, :] >= visible[rows, None], float("-inf"))
            picked = padded.topk(min(self.topk, width), dim=-1).indices
            chosen[rows, : picked.shape[1]] = torch.where(picked >= visible[rows, None], -1, picked)
        return chosen


class V4Attention(nn.Module):
    """One DeepSeek-V4 attention layer (sliding, CSA or HCA), over one sequence's caches at a time."""

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

    def forward(self, h: torch.Tensor, first: int, cache: V4Cache, prompt_len: int = 0) -> torch.Tensor:
        """Rows h [n, hidden] (normed) of one sequence at positions ``first ..`` of a ``prompt_len``-token prompt
        (0: every row generated): [n, hidden]."""
        g, n = self.g, h.shape[0]
        positions = torch.arange(first, first + n, device=h.device)
        cos, sin = tail_rope_cos_sin(*self.rope, positions, h.dtype)
        q_resid = rms_norm_fp32_weight(F.linear(h, self.q_a_proj.weight), self.q_a_norm.weight, g.eps)
        q = rms_norm_unweighted(F.linear(q_resid, self.q_b_proj.weight).view(n, g.heads, g.head_dim), g.eps)
        q = rope_tail(q, cos, sin)
        kv = rope_tail(rms_norm_fp32_weight(F.linear(h, self.kv_proj.weight), self.kv_norm.weight, g.eps), cos, sin)
        cache.write_kv(first, kv)
        lo = max(0, first - g.window + 1)
        keys = cache.read_kv(lo, first + n)  # every row's window: [lo, its position]
        key_pos = torch.arange(lo, first + n, device=h.device)
        allowed = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] > positions[:, None] - g.window)
        if g.compress:
            count = self.compressor.step("compressor", h, first, cache, *self.compress_rope)
            if g.sparse:
                self.compressor.indexer.step("indexer", h, first, cache, *self.compress_rope)
            if count:
                ids, seen = self._entries_seen(h, q_resid, positions, count, cache, prompt_len)
                keys = torch.cat([keys, cache.read_entries("compressor", ids)])
                allowed = torch.cat([allowed, seen], dim=1)
        out = _attend_with_sinks(q, keys, allowed, self.sinks, g.head_dim**-0.5)
        out = rope_tail(out, cos, -sin)
        grouped = out.reshape(n, g.o_groups, -1).transpose(0, 1)  # [groups, n, heads * dim / groups]
        w = self.o_a_proj.weight.view(g.o_groups, -1, grouped.shape[-1]).transpose(1, 2)
        mixed = torch.bmm(grouped, w).transpose(0, 1).reshape(n, -1)
        return F.linear(mixed, self.o_b_proj.weight)

    def _entries_seen(self, h: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor, count: int,
                      cache: V4Cache, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the entries the rows attend, ascending [e]; which row sees which [rows, e]): on HCA every entry whose
        window closed at or before the row; on CSA only those the indexer chose, so only they are read."""
        g = self.g
        if not g.sparse:
            ids = torch.arange(count, device=h.device)
            return ids, ids[None, :] < ((positions + 1) // g.compress)[:, None]
        cos, sin = tail_rope_cos_sin(*self.compress_rope, positions, h.dtype)
        keys = cache.read_entries("indexer", torch.arange(count, device=h.device))
        chosen = self.compressor.indexer.choose(h, q_resid, keys, positions, cos, sin, prompt_len)
        ids = torch.unique(chosen[chosen >= 0])  # ascending: every entry any row chose, read once
        at = torch.searchsorted(ids, chosen.clamp(min=0))
        seen = torch.zeros(h.shape[0], len(ids) + 1, dtype=torch.bool, device=h.device)
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

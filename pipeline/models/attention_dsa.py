"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA over the tokens a lightning indexer picks, read from
the tiers on demand.

Per token and layer the cache holds MLA's latent (group 0) and the indexer's key (a cache group of its own,
``models.cache_groups``): ``wk`` of the normed hidden state, LayerNorm'd, its first ``qk_rope_head_dim``
values rotated (half-split RoPE, unlike MLA's interleaved pairs). A query's indexer heads come from the q
LoRA (``wq_b`` of ``q_a_layernorm(q_a_proj(x))``), rotated alike, and weighted per head by
``weights_proj(x)``. For each sequence of the step the indexer scores every cached token
(``kernels.sparse_index``: every indexer key is read, the small ones), keeps the top ``index_topk`` per
query row, and the attention then reads only the latents of the chosen tokens: from the device blocks, or
for a spilled prefix only the spilled blocks that hold a chosen token. Attention runs in the weight-absorbed
form, as MLA's (``attention_mla``). GLM-5 rotates the indexer's RoPE dims in interleaved pairs, and some of
its layers run no indexer: they attend over the previous indexer layer's choice for the same rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import AttentionBackend, AttentionMetadata, linear, rms_norm, rotate_heads, write_cache
from strata.kernels.sparse_index import index_scores, select_topk, sparse_latent_attention
from strata.kvstore.sparse_reads import SparseReads
from strata.pipeline.models.attention_mla import LATENT_NORM_EPS, MLAAttention
from strata.pipeline.models.dsa_decode_batch import chosen_latents, choose_together, count_together, decode_sequences
from strata.pipeline.models.text_config import TextConfig

INDEXER_NORM_EPS = 1e-6  # the indexer's key LayerNorm


class Indexer(nn.Module):
    """The lightning indexer's parameters, under the release's names."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        d, m = cfg.dsa, cfg.mla
        assert d is not None and m is not None and m.q_lora_rank
        self.n_heads, self.head_dim, self.topk = d.n_heads, d.head_dim, d.topk
        rope = m.qk_rope_head_dim  # GLM-5 rotates (x0, x1), (x2, x3), ...: evens then odds first makes it ours
        self._pairs = (torch.cat([torch.arange(0, rope, 2, device="cpu"), torch.arange(1, rope, 2, device="cpu")])
                       if d.rope_interleave else None)
        self.wq_b = nn.Linear(m.q_lora_rank, d.n_heads * d.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, d.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(d.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(cfg.hidden_size, d.n_heads, bias=False)

    def key(self, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """The key each new token caches: [T, 1, head_dim]."""
        k = F.layer_norm(linear(h, self.wk.weight), (self.head_dim,), self.k_norm.weight, self.k_norm.bias,
                         INDEXER_NORM_EPS)
        return self._rotate(k[:, None], cos, sin_signed)

    def query(self, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows' indexer queries [T, heads, head_dim], their head weights [T, heads] in fp32)."""
        q = linear(q_resid, self.wq_b.weight).view(h.shape[0], self.n_heads, self.head_dim)
        weights = linear(h, self.weights_proj.weight).float() * self.n_heads**-0.5
        return self._rotate(q, cos, sin_signed), weights

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """RoPE over the first rotary dims of each head, the rest passed through. Interleaved pairs come out
        as [rotated evens, rotated odds] as transformers' form writes them (queries and keys alike)."""
        if self._pairs is not None:
            rot = cos.shape[-1]
            x = torch.cat([x[..., :rot].index_select(-1, self._pairs.to(x.device)), x[..., rot:]], dim=-1)
        return rotate_heads(x.contiguous(), cos, sin_signed)


class DSAAttention(MLAAttention):
    """MLA whose queries attend only over their indexer's top-k tokens: its own indexer's, or on a GLM-5 layer
    that shares, the previous indexer layer's choice in this step (``meta.prepared``)."""

    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.runs_indexer = cfg.dsa.runs_indexer(layer_idx)
        self.index_scale: float | None = None  # an FP8 cache's scale of this layer's indexer keys (``kv_scales``)
        if self.runs_indexer:
            self.indexer = Indexer(cfg)
            self.index_layer = cfg.index_kv_index(layer_idx)  # its KV-layout layer of indexer keys

    def run(self, x: torch.Tensor, ln: nn.Module, cos: torch.Tensor, sin_signed: torch.Tensor, kv: list[torch.Tensor],
            meta: AttentionMetadata, backend: AttentionBackend, steps: object = None) -> torch.Tensor:
        """Input norm, projections, latent and indexer-key writes, selection, sparse absorbed attention:
        [T, H, v_head_dim] before o_proj. (The attention backend is not used: rows read gathered latents.)"""
        h = rms_norm(x, ln.weight, ln.eps)
        q_resid = rms_norm(linear(h, self.q_a_proj.weight), self.q_a_layernorm.weight, LATENT_NORM_EPS)
        q_nope, q_pe, latent = self.project(h, cos, sin_signed, q_resid)
        cache = kv[self.layer_idx][:, 0]
        s = self.kv_scales[0] if self.kv_scales is not None else None  # FP8: the latent stored over its scale
        write_cache(cache, latent if s is None else latent / s, meta.slot_mapping, meta.slot_blocks,
                    meta.slot_offsets)
        if self.runs_indexer:
            keys = kv[self.index_layer][:, 0]
            key = self.indexer.key(h, cos, sin_signed)
            write_cache(keys, key if self.index_scale is None else key / self.index_scale, meta.slot_mapping,
                        meta.slot_blocks, meta.slot_offsets)
            iq, weights = self.indexer.query(h, q_resid, cos, sin_signed)
        w_uk, w_uv = self.absorbed()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)  # [T, H, rank]
        q = torch.cat([q_latent, q_pe], dim=-1)
        if s is not None:  # softmax(q.(s c)) = softmax((s q).c); the output is s times the stored values'
            q = q * s
        out = q.new_empty(q.shape[0], self.num_heads, self.rank)
        together = decode_sequences(meta)
        if together:
            at = meta.query_start_loc[together]
            out[at] = self._decode_together(together, q[at], cache, keys if self.runs_indexer else None,
                                            (iq[at], weights[at]) if self.runs_indexer else None, meta)
        start, skip = 0, set(together)
        for i, (rows, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_list)):
            r = slice(start, start + rows)
            start += rows
            if i in skip:
                continue
            if self.runs_indexer:  # stored FP8 keys score 1/s of their values: a power of two, the same top-k
                context, key_device, key_spilled = gather_context(keys, meta, i, self.index_layer, seq_len)
                chosen = self._select(iq[r], weights[r], context[:, 0].to(iq.dtype), seq_len, meta.prompt_len(i))
                meta.prepared[("dsa", i)] = chosen  # for the layers after it that share its choice
            else:
                chosen, key_device, key_spilled = meta.prepared[("dsa", i)], 0, 0
            needed = torch.unique(chosen[chosen >= 0])  # ascending: every latent any row chose, read once
            latents, latent_device, latent_spilled = gather_tokens(cache, meta, i, self.layer_idx, needed)
            at = torch.searchsorted(needed, chosen.clamp(min=0))  # each choice's row in ``latents``
            step = _group(chosen.shape[1] * latents.shape[-1])  # rows whose [k, latent] gathers fit at once
            for g in range(0, rows, step):
                local = slice(g, min(g + step, rows))
                out[r][local] = sparse_latent_attention(q[r][local], latents[at[local], 0], chosen[local] >= 0,
                                                        self.rank, self.scale)
            if meta.sparse_reads is not None:
                _count(meta.sparse_reads, meta, i, needed, key_device, key_spilled, latent_device, latent_spilled)
        if s is not None:
            out = out * s
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2).to(out.dtype)).transpose(0, 1).contiguous()

    def _decode_together(self, seqs: list[int], q: torch.Tensor, cache: torch.Tensor, keys: torch.Tensor | None,
                         index_q: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata) -> torch.Tensor:
        """The rows of ``seqs`` (one each, every block on the device: ``dsa_decode_batch``) selected and attended
        together: [B, H, rank]."""
        if keys is not None and index_q is not None:
            chosen = choose_together(*index_q, keys, meta, seqs, self.indexer.head_dim**-0.5, self.indexer.topk)
            for j, i in enumerate(seqs):
                meta.prepared[("dsa", i)] = chosen[j : j + 1]  # for the layers after it that share its choice
        else:
            parts = [meta.prepared[("dsa", i)] for i in seqs]
            width = max(p.shape[1] for p in parts)
            chosen = torch.cat([F.pad(p, (0, width - p.shape[1]), value=-1) for p in parts])
        latents = chosen_latents(cache, meta, seqs, chosen)
        if meta.sparse_reads is not None:
            key_bytes = keys[0, 0].numel() * keys.element_size() if keys is not None else 0
            count_together(meta, seqs, chosen, key_bytes, cache[0, 0].numel() * cache.element_size())
        return sparse_latent_attention(q, latents, chosen >= 0, self.rank, self.scale)

    def _select(self, iq: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, seq_len: int,
                prompt_len: int) -> torch.Tensor:
        """One sequence's rows' choices, int64 [rows, k] (``kernels.sparse_index.select_topk``), scored a group of
        rows at a time so that [rows, tokens] scores stay bounded at a million tokens."""
        rows, parts = iq.shape[0], []
        step = _group(max(seq_len, prompt_len))
        for g in range(0, rows, step):
            scores = index_scores(iq[g : g + step], keys, weights[g : g + step], self.indexer.head_dim**-0.5)
            positions = list(range(seq_len - rows + g, seq_len - rows + min(g + step, rows)))
            parts.append(select_topk(scores, positions, prompt_len, self.indexer.topk))
        width = max(p.shape[1] for p in parts)
        return torch.cat([F.pad(p, (0, width - p.shape[1]), value=-1) for p in parts])


ROW_GROUP_VALUES = 1 << 24  # values one group of rows may hold at once (64 MiB in fp32)


def _group(values_per_row: int) -> int:
    """Rows processed together when each holds ``values_per_row`` values."""
    return max(1, ROW_GROUP_VALUES // max(1, values_per_row))


def _count(reads: SparseReads, meta: AttentionMetadata, seq: int, needed: torch.Tensor, key_device: int,
           key_spilled: int, latent_device: int, latent_spilled: int) -> None:
    """One selection's reads into the KV cache's counters (``kvstore.sparse_reads``)."""
    spilled_blocks = meta.kv_offset(seq) // meta.block_size
    reads.reads += 1
    reads.index_key_bytes_device += key_device
    reads.index_key_bytes_spilled += key_spilled
    reads.latent_bytes_device += latent_device
    reads.latent_bytes_spilled += latent_spilled
    reads.spilled_blocks_seen += spilled_blocks
    reads.spilled_blocks_read += len(torch.unique(torch.div(needed[needed < meta.kv_offset(seq)], meta.block_size,
                                                            rounding_mode="floor")))


def gather_context(cache: torch.Tensor, meta: AttentionMetadata, seq: int, layer: int, seq_len: int
                   ) -> tuple[torch.Tensor, int, int]:
    """All ``seq_len`` cached vectors of sequence ``seq`` in KV-layout ``layer`` (its indexer keys), as
    :func:`gather_tokens` returns them; the spilled prefix from the device copy of it
    (``meta.layer_mirror``, ``kvstore.layer_mirror``) when there is one, which reads only blocks it lacks."""
    offset = meta.kv_offset(seq)
    if not offset or meta.layer_mirror is None or meta.spilled is None or meta.spilled[seq] is None:
        return gather_tokens(cache, meta, seq, layer, torch.arange(seq_len))
    spilled, loaded = meta.layer_mirror.tokens(meta.spilled[seq], layer, offset // meta.block_size)
    resident, device_bytes, _ = gather_tokens(cache, meta, seq, layer, torch.arange(offset, seq_len))
    kept = spilled.numel() * spilled.element_size() - loaded  # read from the device copy
    return torch.cat([spilled.to(resident.dtype), resident]), device_bytes + kept, loaded


def gather_tokens(cache: torch.Tensor, meta: AttentionMetadata, seq: int, layer: int, positions: torch.Tensor,
                  ) -> tuple[torch.Tensor, int, int]:
    """Sequence ``seq``'s cached vectors [n, heads, dim] of KV-layout ``layer`` at absolute ``positions``
    (ascending): from its device blocks, or, before its first resident token, from the lower tiers, loading
    only the spilled blocks that hold one of them, runs of consecutive blocks a segment at a time. Also returns
    (bytes read from the device, bytes loaded from the tiers)."""
    bs, offset = meta.block_size, meta.kv_offset(seq)
    out = cache.new_empty((len(positions),) + tuple(cache.shape[2:]))
    resident = positions >= offset
    local = positions[resident] - offset
    blocks = meta.block_tables[seq, torch.div(local, bs, rounding_mode="floor")].long()
    out[resident] = cache[blocks, local % bs]
    token_bytes = out[0].numel() * out.element_size() if len(out) else 0
    spilled = positions[~resident]
    if not len(spilled):
        return out, len(local) * token_bytes, 0
    source = meta.spilled[seq] if meta.spilled is not None else None
    if source is None:
        raise RuntimeError("tokens before the device blocks, but no spilled source for them")
    rows, block_of = torch.nonzero(~resident).flatten(), torch.div(spilled, bs, rounding_mode="floor")
    needed = torch.unique(block_of).tolist()
    for first, count in _runs(needed, source.segment_blocks):
        k, _ = source.load(layer, first, count)  # [count, bs, heads, dim], valid until the next load
        here = (block_of >= first) & (block_of < first + count)
        out[rows[here]] = k[block_of[here] - first, spilled[here] % bs].to(out.dtype)
    return out, len(local) * token_bytes, len(needed) * bs * token_bytes


def _runs(blocks: list[int], longest: int) -> list[tuple[int, int]]:
    """Ascending block indices as (first, count) runs of consecutive blocks, none longer than ``longest``."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][0] + runs[-1][1] == b and runs[-1][1] < longest:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs

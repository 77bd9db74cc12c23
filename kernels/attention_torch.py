"""Torch reference attention: exact, readable, runs anywhere. Other backends are tested against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.attention_metadata import AttentionMetadata
from strata.kernels.attention_backend import AttentionBackend
from strata.kernels.merge import merge_attention_states

_SCORE_ELEMS = 1 << 25  # most fp32 attention scores (or mask entries) materialized at once (128 MiB)
# torch's fused CPU attention that also returns the log-sum-exp (a private op: used when present).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
USE_FUSED_LSE = True  # tests switch it off to compare against the explicit path


def attend_with_positions(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_valid: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    need_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal (optionally windowed) GQA attention with explicit absolute positions.

    q [B, Tq, Hq, D], k/v [B, S, Hkv, D], q_pos [B, Tq], k_pos [B, S], k_valid bool [B, S].
    Returns out [B, Tq, Hq, D] (dtype of q) and lse [B, Tq, Hq] (fp32, or None unless
    ``need_lse``). With lse, a query row with no visible key gets out 0 and lse -inf, so
    segments merge cleanly.
    """
    b, tq, hq, _ = q.shape
    seg = max(1, _SCORE_ELEMS // max(1, b * tq * hq))
    if need_lse and k.shape[1] > seg:
        # Bound the materialized scores: attend to key segments and merge them exactly.
        out, lse = None, None
        for lo in range(0, k.shape[1], seg):
            sl = slice(lo, lo + seg)
            o, l = _attend(q, k[:, sl], v[:, sl], q_pos, k_pos[:, sl], k_valid[:, sl], scale, sliding_window, True)
            out, lse = (o, l) if out is None else merge_attention_states(out, lse, o, l)
        return out, lse
    return _attend(q, k, v, q_pos, k_pos, k_valid, scale, sliding_window, need_lse)


def _attend(q, k, v, q_pos, k_pos, k_valid, scale, sliding_window, need_lse):
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    visible = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        visible = visible & (k_pos[:, None, :] > q_pos[:, :, None] - sliding_window)
    if need_lse and USE_FUSED_LSE and q.device.type == "cpu" and _FLASH_CPU is not None:
        return _attend_fused_lse(q, k, v, visible, scale, g)
    if not need_lse:
        # Fused path (every row sees at least itself, so no empty-row NaN): same math, one kernel.
        out = F.scaled_dot_product_attention(
            q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
            attn_mask=visible[:, None], scale=scale, enable_gqa=True,
        )
        return out.transpose(1, 2).to(q.dtype), None
    # Queries of one KV head's group share its keys: fold the group into the row dimension so
    # the score matmul batches over (B, Hkv) without broadcasting (and copying) K per query head.
    qh = q.float().view(b, tq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * tq, d)
    kh = k.float().permute(0, 2, 1, 3)  # B,Hkv,S,D
    vh = v.float().permute(0, 2, 1, 3)
    scores = torch.matmul(qh, kh.transpose(-1, -2)).mul_(scale).view(b, hkv, g, tq, -1)
    scores.masked_fill_(~visible[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # B,Hkv,G,Tq
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
    lse = lse.permute(0, 3, 1, 2).reshape(b, tq, hq)
    out = torch.matmul(probs.view(b, hkv, g * tq, -1), vh)  # B,Hkv,G*Tq,D
    out = out.view(b, hkv, g, tq, d).permute(0, 3, 1, 2, 4).reshape(b, tq, hq, d)
    return out.to(q.dtype), lse


def _attend_fused_lse(q, k, v, visible, scale, g):
    """The same math through torch's fused CPU flash kernel, which also returns the LSE: no
    [Tq, S] score matrix is written (the explicit path below is memory-bound at long range)."""
    dtype = torch.float32
    qh = q.to(dtype).transpose(1, 2)
    kh = k.to(dtype).transpose(1, 2)
    vh = v.to(dtype).transpose(1, 2)
    if g > 1:
        kh, vh = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
    mask = None
    if not bool(visible.all()):
        mask = torch.zeros(visible.shape, dtype=dtype, device=q.device).masked_fill_(~visible, float("-inf"))[:, None]
    out, lse = _FLASH_CPU(qh, kh, vh, 0.0, False, attn_mask=mask, scale=scale)
    lse = lse.transpose(1, 2).contiguous()  # B,Tq,Hq
    lse.masked_fill_(~visible.any(-1)[:, :, None], float("-inf"))  # the kernel reports 0 for a row with no key
    return out.transpose(1, 2).to(q.dtype), lse


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[blocks, bs, H, D] cache + [B, nb] ids -> [B, nb*bs, H, D] contiguous keys or values."""
    b, nb = block_ids.shape
    gathered = torch.index_select(cache, 0, block_ids.reshape(-1))  # B*nb, bs, H, D
    return gathered.view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3])


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention. Decodes are batched; each prefill chunk runs on its own."""

    name = "torch"
    reads_fp8_kv = True  # every read widens (.float() / .to(dtype)) before the math

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        return_lse: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
        decode_rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
        if decode_rows:
            self._decode(q, k_cache, v_cache, meta, decode_rows, scale, sliding_window, out, lse)
        starts = meta.query_start_loc.tolist()
        for i, n in enumerate(meta.query_lens):
            if n > 1:
                self._chunk(q, k_cache, v_cache, meta, i, starts[i], scale, sliding_window, out, lse)
        return out, lse

    def _decode(self, q, k_cache, v_cache, meta, rows, scale, window, out, lse) -> None:
        bs = meta.block_size
        idx = torch.tensor(rows, dtype=torch.int64, device=q.device)
        seq_lens = meta.seq_lens[idx]
        offsets = torch.tensor([meta.kv_offset(i) for i in rows], dtype=torch.int64, device=q.device)
        nb = -(-max(meta.seq_lens_list[i] - meta.kv_offset(i) for i in rows) // bs)
        tables = meta.block_tables[idx, :nb]
        k = gather_blocks(k_cache, tables)
        v = gather_blocks(v_cache, tables)
        k_pos = offsets[:, None] + torch.arange(k.shape[1], device=q.device).unsqueeze(0)
        k_valid = k_pos < seq_lens[:, None]
        q_rows = meta.query_start_loc[idx]
        o, l = attend_with_positions(
            q[q_rows].unsqueeze(1), k, v, (seq_lens - 1)[:, None], k_pos, k_valid, scale, window, lse is not None
        )
        out[q_rows] = o[:, 0]
        if lse is not None:
            lse[q_rows] = l[:, 0]

    def _chunk(self, q, k_cache, v_cache, meta, i, start, scale, window, out, lse) -> None:
        bs = meta.block_size
        n = meta.query_lens[i]
        seq_len = meta.seq_lens_list[i]
        first_pos = seq_len - n
        base = meta.kv_offset(i)
        # Keys before the window of the first query can never be seen: skip their blocks.
        lo_block = max(0, first_pos - window + 1 - base) // bs if window is not None else 0
        hi_block = -(-(seq_len - base) // bs)
        k = gather_blocks(k_cache, meta.block_tables[i : i + 1, lo_block:hi_block])
        v = gather_blocks(v_cache, meta.block_tables[i : i + 1, lo_block:hi_block])
        first_key = base + lo_block * bs
        k_pos = torch.arange(first_key, first_key + k.shape[1], device=q.device).unsqueeze(0)
        q_pos = torch.arange(first_pos, seq_len, device=q.device).unsqueeze(0)
        o, l = attend_with_positions(
            q[start : start + n].unsqueeze(0), k, v, q_pos, k_pos, k_pos < seq_len, scale, window, lse is not None
        )
        out[start : start + n] = o[0]
        if lse is not None:
            lse[start : start + n] = l[0]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Bidirectional attention over one image's tokens ([B, H, T, D]), as the vision tower needs."""
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of packed tokens (q, k, v: [N, H, D]), never
    across them: each image of a packed batch, or each window of a windowed vision layer. Segments of one
    length run as one batch (windows are mostly full-size), so nothing is padded and no Python loop runs
    per segment; the result is exactly per-segment attention. Returns [N, H, D]."""
    out = torch.empty_like(q)
    starts = torch.tensor([0, *lengths], device="cpu").cumsum(0)[:-1]
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            by_length.setdefault(n, []).append(i)
    for n, segments in by_length.items():
        rows = (starts[segments][:, None] + torch.arange(n)[None]).to(q.device)  # [segments, n]
        qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))  # [segments, H, n, D]
        out[rows] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2)
    return out

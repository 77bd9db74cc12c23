"""Our own Triton paged-attention kernel: the fast backend on CUDA (``triton``).

One launch per layer covers every sequence of the step, decodes and prefill chunks alike. A
program owns a tile of ``BLOCK_M`` query rows of one sequence for a group of query heads that share
one KV head (GQA, MLA): it walks the sequence's KV blocks through the block table (keys read in
place from the pool, once for the whole group, no gather), keeps an online softmax in fp32, and
writes the output rows and their log-sum-exp (the tier path merges spilled blocks by it). Causal
over absolute positions, with an optional sliding window. bf16/fp16 caches use tensor-core dots
(fp32 accumulation, probabilities rounded to the cache dtype for the value product, as FlashAttention
does); fp32 caches use exact fp32 dots.

Tested on CPU against the torch reference under ``TRITON_INTERPRET=1`` (set before Triton is
imported), which runs the same kernel code in Triton's interpreter.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from strata.kernels.attention_backend import AttentionBackend
from strata.kernels.attention_metadata import AttentionMetadata

BLOCK_M = 16  # query rows per program

_triton = None


def _load():
    """Import Triton and define the kernel on first use (Triton is optional: CUDA hosts have it)."""
    global _triton
    if _triton is None:
        import triton
        import triton.language as tl

        @triton.jit
        def paged_attention_kernel(
            q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
            tile_seq_ptr, tile_row_ptr, q_start_ptr, seq_len_ptr, kv_off_ptr, table_ptr,
            stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_ot, stride_oh, stride_lt, stride_table, scale, window,
            GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, WANT_LSE: tl.constexpr, EXACT: tl.constexpr,
            UPCAST_DOTS: tl.constexpr,
        ):
            # Rows of this program: BLOCK_M query positions x HEADS query heads that share one KV head,
            # so each key/value block is read once for all of them.
            tile = tl.program_id(0)
            first_head = tl.program_id(1) * HEADS
            kv_head = first_head // GROUP
            seq = tl.load(tile_seq_ptr + tile)
            row0 = tl.load(tile_row_ptr + tile)
            q_start = tl.load(q_start_ptr + seq)
            q_len = tl.load(q_start_ptr + seq + 1) - q_start
            seq_len = tl.load(seq_len_ptr + seq)
            kv_off = tl.load(kv_off_ptr + seq)
            r = tl.arange(0, BLOCK_M * HEADS)
            rows = row0 + r // HEADS
            heads = first_head + r % HEADS
            row_ok = rows < q_len
            pos = seq_len - q_len + rows  # absolute position of each query row
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            m = tl.full([BLOCK_M * HEADS], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_M * HEADS], tl.float32)
            acc = tl.zeros([BLOCK_M * HEADS, BLOCK_D], tl.float32)
            last_pos = seq_len - q_len + tl.minimum(row0 + BLOCK_M, q_len) - 1
            first_key = kv_off
            if window > 0:
                first_key = tl.maximum(kv_off, seq_len - q_len + row0 - window + 1)
            start_block = (first_key - kv_off) // BLOCK_SIZE
            end_block = (last_pos - kv_off) // BLOCK_SIZE + 1
            t = tl.arange(0, BLOCK_SIZE)
            for b in range(start_block, end_block):
                block = tl.load(table_ptr + seq * stride_table + b).to(tl.int64)
                key_pos = kv_off + b * BLOCK_SIZE + t
                kv_ok = (key_pos < seq_len)[:, None] & d_ok[None, :]
                k = tl.load(k_ptr + block * stride_kb + t[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                            mask=kv_ok, other=0.0)
                v = tl.load(v_ptr + block * stride_vb + t[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                            mask=kv_ok, other=0.0)
                # fp32 caches: exact fp32 dots; bf16/fp16: tensor-core dots accumulating in fp32
                if EXACT:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
                elif UPCAST_DOTS:
                    s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale
                else:
                    s = tl.dot(q, tl.trans(k)) * scale
                visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] < seq_len) & row_ok[:, None]
                if window > 0:
                    visible = visible & (key_pos[None, :] > pos[:, None] - window)
                s = tl.where(visible, s, float("-inf"))
                new_m = tl.maximum(m, tl.max(s, 1))
                safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
                p = tl.exp(s - safe_m[:, None])
                correction = tl.exp(m - safe_m)
                l = l * correction + tl.sum(p, 1)
                if EXACT:
                    acc = acc * correction[:, None] + tl.dot(p, v, input_precision="ieee")
                elif UPCAST_DOTS:
                    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
                else:
                    acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
                m = new_m
            out = acc / tl.where(l > 0, l, 1.0)[:, None]
            tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
            if WANT_LSE:
                lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))
                tl.store(lse_ptr + (q_start + rows) * stride_lt + heads, lse, mask=row_ok)

        _triton = (triton, paged_attention_kernel)
    return _triton


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def heads_per_program(group: int, block_d: int) -> int:
    """Query heads one program serves: the largest power of two dividing the GQA group, capped so a
    program's rows (``BLOCK_M`` x heads) times its head dim stay a register-sized tile."""
    cap = max(1, 1024 // block_d)  # 8 heads at head_dim 128, 1 for MLA's 576-wide latent
    heads = 1
    while group % (heads * 2) == 0 and heads * 2 <= cap:
        heads *= 2
    return heads


@dataclass
class _Tiles:
    seq: torch.Tensor  # int32 [tiles]: the sequence of each program's query tile
    row: torch.Tensor  # int32 [tiles]: its first query row within the sequence


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
        return triton_importable() and (device.type == "cuda" or interpreting())

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
        triton, kernel = _load()
        bs = meta.block_size
        if bs < 16 or bs & (bs - 1):
            raise ValueError(f"the triton backend needs KV blocks of a power of two >= 16 tokens, not {bs}")
        tiles = self._tiles(meta, q.device)
        t, hq, d = q.shape
        group = hq // k_cache.shape[2]
        block_d = triton.next_power_of_2(max(d, 16))
        heads = heads_per_program(group, block_d)
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
        lse = torch.empty((t, hq), dtype=torch.float32, device=q.device) if return_lse else torch.empty((1, 1), device=q.device)
        if tiles.seq.numel():
            grid = (tiles.seq.numel(), hq // heads)
            kernel[grid](
                q, k_cache, v_cache, out, lse, tiles.seq, tiles.row, meta.query_start_loc, meta.seq_lens,
                meta.kv_offsets_t, meta.block_tables,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), lse.stride(0),
                meta.block_tables.stride(0), scale, sliding_window or 0,
                GROUP=group, HEADS=heads, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_SIZE=bs, BLOCK_M=BLOCK_M,
                WANT_LSE=return_lse, EXACT=k_cache.dtype == torch.float32,
                # Triton's interpreter multiplies bf16 as raw bits: it gets the same products in fp32
                UPCAST_DOTS=interpreting() and k_cache.dtype == torch.bfloat16,
            )
        return out, (lse if return_lse else None)

    @staticmethod
    def _tiles(meta: AttentionMetadata, device: torch.device) -> _Tiles:
        """Query tiles of every sequence, built once per step for every layer."""
        tiles = meta.prepared.get("triton")
        if tiles is None:
            seqs, rows = [], []
            for i, n in enumerate(meta.query_lens):
                for r in range(0, n, BLOCK_M):
                    seqs.append(i)
                    rows.append(r)
            tiles = meta.prepared["triton"] = _Tiles(torch.tensor(seqs, dtype=torch.int32, device=device),
                                                      torch.tensor(rows, dtype=torch.int32, device=device))
        return tiles

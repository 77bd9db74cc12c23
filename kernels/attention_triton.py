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

import os
from dataclasses import dataclass

import torch

from strata.kernels.attention_backend import AttentionBackend
from strata.kernels.attention_metadata import AttentionMetadata
from strata.kernels.triton_import import triton_importable, triton_kernel

BLOCK_M = 16  # query rows per program


def _load():
    return triton_kernel("attention_triton_kernel", "paged_attention_kernel")


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
    reads_fp8_kv = True  # e4m3 bytes widened to the query's dtype as each block is read

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
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        if fp8:  # read as bytes and widened in the kernel (no float8 loads: the interpreter has none)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
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
                WANT_LSE=return_lse, EXACT=q.dtype == torch.float32,
                # Triton's interpreter multiplies bf16 as raw bits: it gets the same products in fp32
                UPCAST_DOTS=interpreting() and q.dtype == torch.bfloat16, FP8_KV=fp8,
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

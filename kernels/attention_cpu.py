"""The fast CPU backend: one paged-attention kernel call for every decode of the step, and torch's
fused flash kernel for long prefill chunks.

Measured on this project's CPU (``strata bench offline``, kernel micro-benchmarks in the closing notes
of the engine-speed issue): the C++ kernel (``csrc/paged_attention_cpu.cpp``) reads keys and values in
place from the paged pool, so a batch of decodes costs one pass over their KV (about 4x faster than
gathering blocks and calling SDPA). For a long chunk, torch's flash kernel (blocked GEMMs) computes
faster than any per-row loop, so a chunk's keys are gathered once and attended in two flash calls
without a mask: its own keys causally, the earlier keys in full (GQA groups folded into rows), merged
by log-sum-exp. Sliding windows and short chunks go to the kernel as well. The result equals the
torch reference to float rounding; log-sum-exp is returned for the tier path whenever asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.kernels.attention_backend import AttentionBackend
from strata.kernels.attention_metadata import AttentionMetadata
from strata.kernels.attention_torch import gather_blocks
from strata.kernels.cpu_kernels import cpu_kernels
from strata.kernels.merge import merge_attention_states

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_MIN_QUERIES = 32  # chunks at least this long use the flash path; shorter ones the kernel
# Query heads per KV head from which decodes and short chunks take a GEMM path: MLA's absorbed form is
# an MQA of every head over one latent, and folding the heads into query rows turns a sequence's
# attention into two GEMMs over its keys read once (the per-head kernel reads every key once per head;
# measured in `strata bench mla`: 64 heads over a 576-value latent at 32K context in bf16, 169 ms a step
# through the kernel, 49 ms this way, most of it the gather of the blocks).
GEMM_MIN_GROUP = 16
_NO_LSE = torch.empty(0)


@dataclass
class _Plan:
    kernel_seqs: torch.Tensor  # int64 indices of the sequences the paged kernel handles
    flash_seqs: list[tuple[int, int]]  # (sequence, first query row) of the chunks for the flash path
    gemm_seqs: list[tuple[int, int]]  # (sequence, first query row) of the grouped short queries for GEMMs


def attend_dtype(cache: torch.dtype, query: torch.dtype) -> torch.dtype:
    """What the flash and GEMM paths multiply in: a half-precision cache in its own dtype, as transformers'
    SDPA does for such a model (the same kernel on the same inputs gives the same bits); an e4m3 cache
    widened to the model's dtype (as vLLM's fp8 KV attends in the query dtype); fp32 stays fp32."""
    if cache in (torch.bfloat16, torch.float16):
        return cache
    if cache == torch.float8_e4m3fn and query in (torch.bfloat16, torch.float16):
        return query
    return torch.float32


class CpuPagedAttentionBackend(AttentionBackend):
    name = "cpu"
    reads_fp8_kv = True  # the kernel widens e4m3 rows as it reads them; the other paths gather, then widen

    def __init__(self) -> None:
        kernels = cpu_kernels()
        if kernels is None:
            raise RuntimeError("the CPU attention kernels could not be built on this machine")
        self._kernels = kernels

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
        return device.type == "cpu" and _FLASH is not None and cpu_kernels() is not None

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
        grouped = q.shape[1] // k_cache.shape[2] >= GEMM_MIN_GROUP
        dtype = attend_dtype(k_cache.dtype, q.dtype)
        plan = self._plan(meta, sliding_window is not None, grouped)
        qf = q.float().contiguous()
        out = torch.empty(qf.shape, dtype=torch.float32, device=qf.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32) if return_lse else _NO_LSE
        if plan.kernel_seqs.numel():
            self._kernels.paged_attention(
                qf, k_cache, v_cache, out, lse, meta.query_start_loc, meta.seq_lens, meta.kv_offsets_t,
                meta.block_tables, plan.kernel_seqs, scale, sliding_window or 0,
            )
        for i, start in plan.flash_seqs:
            self._flash_chunk(qf, k_cache, v_cache, meta, i, start, scale, out, lse if return_lse else None, dtype)
        for i, start in plan.gemm_seqs:
            self._grouped_gemm(qf, k_cache, v_cache, meta, i, start, scale, out, lse if return_lse else None, dtype)
        return out.to(q.dtype), (lse if return_lse else None)

    @staticmethod
    def _plan(meta: AttentionMetadata, windowed: bool, grouped: bool = False) -> _Plan:
        """Which sequences go where; computed once per step (and window setting) for every layer."""
        key = ("cpu", windowed, grouped)
        plan = meta.prepared.get(key)
        if plan is None:
            flash, gemm, rest, start = [], [], [], 0
            for i, n in enumerate(meta.query_lens):
                if windowed:
                    rest.append(i)
                elif n >= FLASH_MIN_QUERIES:
                    flash.append((i, start))
                elif grouped:
                    gemm.append((i, start))
                else:
                    rest.append(i)
                start += n
            plan = meta.prepared[key] = _Plan(torch.tensor(rest, dtype=torch.int64), flash, gemm)
        return plan

    @staticmethod
    def _grouped_gemm(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      i: int, start: int, scale: float, out: torch.Tensor, lse: torch.Tensor | None,
                      dtype: torch.dtype) -> None:
        """A few query rows of many heads per KV head: gather the keys once (once for keys and values when
        they are one tensor, as MLA's latent is), fold the heads into rows, two GEMMs and a softmax. A
        half-precision cache is multiplied in its own dtype, as the flash path and transformers' SDPA do
        (scores round to bf16 before the fp32 softmax: converting 32K latents to fp32 first costs 2.5x)."""
        n, seq_len, base = meta.query_lens[i], meta.seq_lens_list[i], meta.kv_offset(i)
        blocks = meta.block_tables[i, : -(-(seq_len - base) // meta.block_size)]
        k = gather_blocks(k_cache, blocks[None])[0, : seq_len - base].to(dtype)  # [S, Hkv, D]
        v = k if v_cache is k_cache else gather_blocks(v_cache, blocks[None])[0, : seq_len - base].to(dtype)
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        g = hq // hkv
        qg = q[start : start + n].to(dtype).view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)
        # one 2-D GEMM per KV head (torch's CPU bmm over a transposed key view is several times slower)
        scores = torch.stack([qg[h] @ k[:, h].T for h in range(hkv)]).float().mul_(scale)  # [Hkv, g*n, S]
        if n > 1:  # row j (position seq_len - n + j) sees keys up to its own position
            rows = torch.arange(n, device=q.device).repeat(g)
            cols = torch.arange(seq_len - base, device=q.device)
            scores.masked_fill_(cols[None, :] > (seq_len - base - n + rows)[:, None], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [Hkv, g*n]
        probs = torch.exp(scores - row_lse.unsqueeze(-1)).to(dtype)
        o = torch.stack([probs[h] @ v[:, h] for h in range(hkv)]).float()  # [Hkv, g*n, D]
        out[start : start + n] = o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
        if lse is not None:
            lse[start : start + n] = row_lse.view(hkv, g, n).permute(2, 0, 1).reshape(n, hq)

    @staticmethod
    def _flash_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     i: int, start: int, scale: float, out: torch.Tensor, lse: torch.Tensor | None,
                     dtype: torch.dtype) -> None:
        n, seq_len, base = meta.query_lens[i], meta.seq_lens_list[i], meta.kv_offset(i)
        bs = meta.block_size
        blocks = meta.block_tables[i : i + 1, : -(-(seq_len - base) // bs)]
        k = gather_blocks(k_cache, blocks)[0].to(dtype)  # [keys from base, Hkv, D]
        v = gather_blocks(v_cache, blocks)[0].to(dtype)
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        g = hq // hkv
        own = seq_len - n - base  # keys of the chunk itself start here
        qi = q[start : start + n].to(dtype)
        # The chunk's own keys, causally (square, so the kernel's top-left causal mask is right).
        k_own = k[own : own + n].transpose(0, 1).repeat_interleave(g, dim=0)[None]
        v_own = v[own : own + n].transpose(0, 1).repeat_interleave(g, dim=0)[None]
        o, l = _FLASH(qi.transpose(0, 1)[None], k_own, v_own, 0.0, True, scale=scale)[:2]
        o, l = o[0].transpose(0, 1).float(), l[0].transpose(0, 1)  # [n, Hq, D], [n, Hq]
        if own > 0:  # every earlier key is visible to every row: no mask; fold GQA groups into rows
            qg = qi.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * n, d)
            op, lp = _FLASH(qg, k[:own].transpose(0, 1)[None], v[:own].transpose(0, 1)[None], 0.0, False,
                            scale=scale)[:2]
            op = op[0].view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d).float()
            lp = lp[0].view(hkv, g, n).permute(2, 0, 1).reshape(n, hq)
            o, l = merge_attention_states(o, l, op, lp)
        out[start : start + n] = o
        if lse is not None:
            lse[start : start + n] = l

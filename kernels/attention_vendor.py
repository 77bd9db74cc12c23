"""Vendor attention kernels behind the same interface, found at run time and never required.

vLLM's FlashAttention fork (shipped inside vLLM as ``vllm.vllm_flash_attn``; the standalone
``vllm-flash-attn`` wheel, last released in 2024, is found too) and ``flashinfer`` are imported
only if installed, only on CUDA, and only after a one-time self-check on this machine in the dtype
the engine runs: a small random batch (decodes, chunks, a sliding window, log-sum-exp) must match
the torch reference, or the backend reports itself unavailable for that dtype (with one warning)
and ``auto`` moves on to our own Triton kernel. A vendor build that does not match this torch, this
GPU, this dtype or this cache layout therefore degrades to the next backend instead of producing
wrong tokens. FlashInfer returns base-2 log-sum-exp; it is converted to the natural log the tier
merge uses.

Both read the per-layer views of our block-major pool ([blocks, block_size, kv_heads, head_dim]),
with keys ``kv_offsets[i]..seq_len-1`` in the block table; causal masks are bottom-right aligned,
which places each query at its absolute position whatever is spilled before the table.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
import math
from typing import Any, ClassVar

import torch

from strata.kernels.attention_backend import AttentionBackend
from strata.kernels.attention_metadata import AttentionMetadata

log = logging.getLogger(__name__)


class _VendorBackend(AttentionBackend):
    modules: ClassVar[tuple[str, ...]]  # where the kernel may be installed, preferred first
    _verified: ClassVar[dict[tuple[str, torch.dtype], bool]] = {}

    @classmethod
    def module(cls) -> str | None:
        """The first of ``modules`` that is installed (a dotted name imports its parent package to look)."""
        for name in cls.modules:
            try:
                if importlib.util.find_spec(name) is not None:
                    return name
            except (ImportError, ValueError):  # the parent package is missing or broken
                continue
        return None

    @classmethod
    def is_available(cls, device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
        if device.type != "cuda" or cls.module() is None:
            return False
        key = (cls.name, dtype)
        if key not in cls._verified:
            cls._verified[key] = cls._self_check(device, dtype)
        return cls._verified[key]

    @classmethod
    def _self_check(cls, device: torch.device, dtype: torch.dtype) -> bool:
        try:
            check_against_reference(cls(), device, dtype)
            return True
        except Exception as exc:  # any failure: this vendor build is not usable here
            log.warning("attention backend %s unavailable for %s: %s", cls.name, str(dtype).removeprefix("torch."),
                        str(exc).splitlines()[0] if str(exc) else exc)
            return False


def check_against_reference(backend: AttentionBackend, device: torch.device, dtype: torch.dtype) -> None:
    """Raise unless ``backend`` matches the torch reference (output and LSE) on a small random batch
    of decodes and chunks, with and without a sliding window, in ``dtype`` on ``device``."""
    from strata.kernels.attention_torch import TorchAttentionBackend

    gen = torch.Generator(device="cpu").manual_seed(0)
    bs, hq, hkv, d, num_blocks = 16, 8, 2, 64, 24
    seq_lens, query_lens = [1, 40, 70, 33], [1, 40, 1, 20]
    pool = torch.randn(num_blocks, 2, 2, bs, hkv, d, generator=gen).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // bs))] for n in seq_lens]
    slots = [t[p // bs] * bs + p % bs for t, n, ql in zip(tables, seq_lens, query_lens) for p in range(n - ql, n)]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, bs, device)
    q = torch.randn(sum(query_lens), hq, d, generator=gen).to(device, dtype)
    k, v = pool[:, 1, 0], pool[:, 1, 1]
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    for window in (None, 9):
        ref, ref_lse = TorchAttentionBackend().forward(q, k, v, meta, d**-0.5, window, return_lse=True)
        out, lse = backend.forward(q, k, v, meta, d**-0.5, window, return_lse=True)
        if not torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol):
            raise AssertionError(f"{backend.name}: outputs differ from the torch reference (window {window})")
        if lse is None or not torch.allclose(lse.float(), ref_lse.float(), atol=tol, rtol=tol):
            raise AssertionError(f"{backend.name}: log-sum-exp differs from the torch reference (window {window})")


class VllmFlashAttnBackend(_VendorBackend):
    """vLLM's FlashAttention fork: paged varlen attention with a block table and the LSE."""

    name = "vllm_flash_attn"
    modules = ("vllm.vllm_flash_attn", "vllm_flash_attn")

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None,
                return_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        fa = importlib.import_module(self.module() or self.modules[-1])
        used = (meta.seq_lens - meta.kv_offsets_t).to(torch.int32)  # keys held in each block table
        result: Any = fa.flash_attn_varlen_func(
            q=q, k=k_cache, v=v_cache, max_seqlen_q=meta.max_query_len,
            cu_seqlens_q=meta.query_start_loc.to(torch.int32), max_seqlen_k=meta.max_seq_len,
            seqused_k=used, softmax_scale=scale, causal=True,
            window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
            block_table=meta.block_tables, return_softmax_lse=return_lse,
        )
        if not return_lse:
            return (result[0] if isinstance(result, tuple) else result), None
        out, lse = result[0], result[1]
        return out, lse.transpose(0, 1).float().contiguous()  # [heads, tokens] -> [tokens, heads]


class FlashInferBackend(_VendorBackend):
    """FlashInfer's batch prefill over a paged cache (decodes are one-token prefills). One wrapper per
    window lives as long as the backend; it is planned once per step, from host-side lengths (no
    device sync), with the page indices gathered on the device."""

    name = "flashinfer"
    modules = ("flashinfer",)

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[int | None, Any] = {}

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None,
                return_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        wrapper = self._planned(q, k_cache, meta, scale, sliding_window)
        result = wrapper.run(q, (k_cache, v_cache), return_lse=return_lse)
        if not return_lse:
            return result, None
        out, lse = result
        return out, lse.float() * math.log(2.0)  # FlashInfer's LSE is log2-sum-exp2

    def _planned(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 window: int | None) -> Any:
        key = ("flashinfer", window)
        wrapper = meta.prepared.get(key)
        if wrapper is None:
            fi = importlib.import_module("flashinfer")
            if self._workspace is None:
                self._workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
            wrapper = self._wrappers.get(window)
            if wrapper is None:
                wrapper = self._wrappers[window] = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            qo_indptr, kv_indptr, indices, last = flashinfer_pages(meta)
            wrapper.plan(
                qo_indptr, kv_indptr, indices, last, q.shape[1], k_cache.shape[2], q.shape[2], meta.block_size,
                causal=True, sm_scale=scale, window_left=(window - 1) if window else -1, q_data_type=q.dtype,
                kv_data_type=k_cache.dtype,
            )
            meta.prepared[key] = wrapper
        return wrapper


def flashinfer_pages(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table for a step: query and page offsets and last-page lengths on the host
    (from lengths the step already has as lists), page ids gathered from the block tables on the device."""
    bs = meta.block_size
    offsets = meta.kv_offsets or [0] * meta.num_seqs
    used = [s - o for s, o in zip(meta.seq_lens_list, offsets)]
    pages = [-(-n // bs) for n in used]
    qo_indptr = torch.tensor([0, *itertools.accumulate(meta.query_lens)], dtype=torch.int32)
    kv_indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * bs for n, p in zip(used, pages)], dtype=torch.int32)
    tables = meta.block_tables
    width = torch.arange(tables.shape[1], device=tables.device)
    wanted = width[None, :] < torch.tensor(pages, device=tables.device)[:, None]
    return qo_indptr, kv_indptr, tables[wanted].to(torch.int32), last

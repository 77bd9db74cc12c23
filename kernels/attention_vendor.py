"""Vendor attention kernels behind the same interface, found at run time and never required.

``vllm_flash_attn`` (the paged varlen FlashAttention used by vLLM) and ``flashinfer`` are imported
only if installed, only on CUDA, and only after a one-time self-check on this machine: a small
random batch (decodes, chunks, a sliding window, log-sum-exp) must match the torch reference, or
the backend reports itself unavailable (with one warning) and ``auto`` moves on to our own Triton
kernel. A vendor build that does not match this torch, this GPU or this cache layout therefore
degrades to the next backend instead of producing wrong tokens.

Both read the per-layer views of our block-major pool ([blocks, block_size, kv_heads, head_dim]),
with keys ``kv_offsets[i]..seq_len-1`` in the block table; causal masks are bottom-right aligned,
which places each query at its absolute position whatever is spilled before the table.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any, ClassVar

import torch

from strata.kernels.attention_backend import AttentionBackend
from strata.kernels.attention_metadata import AttentionMetadata

log = logging.getLogger(__name__)


class _VendorBackend(AttentionBackend):
    module: ClassVar[str]
    _verified: ClassVar[dict[str, bool]] = {}

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        if device.type != "cuda" or importlib.util.find_spec(cls.module) is None:
            return False
        if cls.name not in cls._verified:
            cls._verified[cls.name] = cls._self_check(device)
        return cls._verified[cls.name]

    @classmethod
    def _self_check(cls, device: torch.device) -> bool:
        from strata.kernels.attention_torch import TorchAttentionBackend

        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            bs, hq, hkv, d, num_blocks = 16, 8, 2, 64, 24
            seq_lens, query_lens = [1, 40, 70, 33], [1, 40, 1, 20]
            pool = torch.randn(num_blocks, 2, 2, bs, hkv, d, generator=gen).to(device, torch.float16)
            perm = torch.randperm(num_blocks, generator=gen).tolist()
            tables = [[perm.pop() for _ in range(-(-n // bs))] for n in seq_lens]
            slots = [t[p // bs] * bs + p % bs for t, n, ql in zip(tables, seq_lens, query_lens) for p in range(n - ql, n)]
            meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, bs, device)
            q = torch.randn(sum(query_lens), hq, d, generator=gen).to(device, torch.float16)
            k, v = pool[:, 1, 0], pool[:, 1, 1]
            for window in (None, 9):
                ref, ref_lse = TorchAttentionBackend().forward(q, k, v, meta, d**-0.5, window, return_lse=True)
                out, lse = cls().forward(q, k, v, meta, d**-0.5, window, return_lse=True)
                ok = torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2) and lse is not None and \
                    torch.allclose(lse.float(), ref_lse.float(), atol=2e-2, rtol=2e-2)
                if not ok:
                    raise AssertionError("results differ from the torch reference")
            return True
        except Exception as exc:  # any failure: this vendor build is not usable here
            log.warning("attention backend %s unavailable: %s", cls.name, str(exc).splitlines()[0] if str(exc) else exc)
            return False


class VllmFlashAttnBackend(_VendorBackend):
    """vLLM's FlashAttention fork: paged varlen attention with a block table and the LSE."""

    name = "vllm_flash_attn"
    module = "vllm_flash_attn"

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None,
                return_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        fa = importlib.import_module(self.module)
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
    """FlashInfer's batch prefill over a paged cache (decodes are one-token prefills), planned once per step."""

    name = "flashinfer"
    module = "flashinfer"

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None,
                return_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        wrapper = self._planned(q, k_cache, meta, scale, sliding_window)
        result = wrapper.run(q, (k_cache, v_cache), return_lse=return_lse)
        if not return_lse:
            return result, None
        out, lse = result
        return out, lse.float()

    def _planned(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 window: int | None) -> Any:
        key = ("flashinfer", window)
        wrapper = meta.prepared.get(key)
        if wrapper is None:
            fi = importlib.import_module(self.module)
            if self._workspace is None:
                self._workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
            bs = meta.block_size
            used = [s - o for s, o in zip(meta.seq_lens_list, meta.kv_offsets or [0] * meta.num_seqs)]
            pages = [-(-n // bs) for n in used]
            indptr, indices = [0], []
            for i, n in enumerate(pages):
                indptr.append(indptr[-1] + n)
                indices.extend(meta.block_tables[i, :n].tolist())
            last = [n - (p - 1) * bs for n, p in zip(used, pages)]
            dev = q.device
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            wrapper.plan(
                meta.query_start_loc.to(torch.int32), torch.tensor(indptr, dtype=torch.int32, device=dev),
                torch.tensor(indices, dtype=torch.int32, device=dev), torch.tensor(last, dtype=torch.int32, device=dev),
                q.shape[1], k_cache.shape[2], q.shape[2], bs, causal=True, sm_scale=scale,
                window_left=(window - 1) if window else -1, q_data_type=q.dtype, kv_data_type=k_cache.dtype,
            )
            meta.prepared[key] = wrapper
        return wrapper

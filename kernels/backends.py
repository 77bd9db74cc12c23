"""Run-time discovery of attention backends.

The torch backend is always present and is the numerical reference. On CPUs the fast backend is
``cpu`` (the paged C++ kernel plus torch's flash kernel), built on first use and skipped if it
cannot be. On CUDA, ``auto`` prefers a vendor kernel (vllm-flash-attn, flashinfer) that is
installed and passes its self-check, then our own ``triton`` kernel, then the reference. Vendor
kernels are optional, found at run time, and never required.
"""

from __future__ import annotations

import torch

from strata.kernels.attention_backend import AttentionBackend
from strata.kernels.attention_cpu import CpuPagedAttentionBackend
from strata.kernels.attention_torch import TorchAttentionBackend
from strata.kernels.attention_triton import TritonAttentionBackend
from strata.kernels.attention_vendor import FlashInferBackend, VllmFlashAttnBackend

REGISTRY: dict[str, type[AttentionBackend]] = {
    cls.name: cls
    for cls in (VllmFlashAttnBackend, FlashInferBackend, TritonAttentionBackend, CpuPagedAttentionBackend,
                TorchAttentionBackend)
}
# What `auto` tries, fastest first, per device type; the reference is always last.
PREFERENCE = {"cuda": ("vllm_flash_attn", "flashinfer", "triton", "torch"), "cpu": ("cpu", "torch")}


def available_backends(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       kv_dtype: torch.dtype | None = None) -> list[str]:
    """Names usable on ``device`` with ``dtype`` right now (and a KV cache of ``kv_dtype``, when it is not
    ``dtype``). Vendor kernels are listed only once their module imports and their self-check passed in
    that dtype."""
    dev = torch.device(device)
    return [name for name in PREFERENCE.get(dev.type, ("torch",))
            if REGISTRY[name].is_available(dev, dtype) and _reads(REGISTRY[name], kv_dtype)]


def _reads(cls: type[AttentionBackend], kv_dtype: torch.dtype | None) -> bool:
    return kv_dtype != torch.float8_e4m3fn or cls.reads_fp8_kv


def vendor_kernels_importable() -> dict[str, bool]:
    """Which vendor kernel packages are importable in this environment (for diagnostics)."""
    return {cls.name: cls.module() is not None for cls in (VllmFlashAttnBackend, FlashInferBackend)}


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu",
                          dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """Instantiate backend ``name``; ``auto`` picks the best available for ``device``, ``dtype`` and the
    cache's ``kv_dtype`` (default: ``dtype``)."""
    if name == "auto":
        name = available_backends(device, dtype, kv_dtype)[0]
    if name not in REGISTRY:
        raise ValueError(f"unknown attention backend {name!r} (known: {', '.join(sorted(REGISTRY))})")
    cls = REGISTRY[name]
    if not cls.is_available(torch.device(device), dtype):
        raise ValueError(f"attention backend {name!r} cannot run on {device} with {str(dtype).removeprefix('torch.')}")
    if not _reads(cls, kv_dtype):
        readers = ", ".join(n for n, c in REGISTRY.items() if c.reads_fp8_kv)
        raise ValueError(f"attention backend {name!r} does not read an fp8 KV cache (backends that do: {readers})")
    return cls()

"""Run-time discovery of attention backends.

The torch backend is always present and is the numerical reference. ``cpu`` (the paged C++ kernel
plus torch's flash kernel) is the fast backend on CPUs; it is built on first use and skipped if it
cannot be. Vendor kernels (vllm-flash-attn, flashinfer) are optional, found at run time, and never
required. ``auto`` picks the first available in ``PREFERENCE`` order for the device.
"""

from __future__ import annotations

import importlib.util

import torch

from strata.kernels.attention_backend import AttentionBackend
from strata.kernels.attention_cpu import CpuPagedAttentionBackend
from strata.kernels.attention_torch import TorchAttentionBackend

REGISTRY: dict[str, type[AttentionBackend]] = {
    CpuPagedAttentionBackend.name: CpuPagedAttentionBackend,
    TorchAttentionBackend.name: TorchAttentionBackend,
}
PREFERENCE = ("cpu", "torch")  # fastest first; the reference is always last


def _vendor_modules() -> dict[str, str]:
    """Vendor backends we know of and the module that would provide each."""
    return {"vllm_flash_attn": "vllm_flash_attn", "flashinfer": "flashinfer"}


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names usable on ``device`` right now. Vendor kernels are listed only once an
    implementation of this interface exists for them and their module imports."""
    dev = torch.device(device)
    return [name for name in PREFERENCE if REGISTRY[name].is_available(dev)]


def vendor_kernels_importable() -> dict[str, bool]:
    """Which vendor kernel packages are importable in this environment (for diagnostics)."""
    return {name: importlib.util.find_spec(mod) is not None for name, mod in _vendor_modules().items()}


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """Instantiate backend ``name``; ``auto`` picks the best available for ``device``."""
    if name == "auto":
        name = available_backends(device)[0]
    if name not in REGISTRY:
        known = ", ".join(sorted(set(REGISTRY) | set(_vendor_modules())))
        raise ValueError(f"attention backend {name!r} is not available here (known: {known})")
    cls = REGISTRY[name]
    if not cls.is_available(torch.device(device)):
        raise ValueError(f"attention backend {name!r} cannot run on {device}")
    return cls()

"""Run-time discovery of attention backends.

The torch backend is always present and is the numerical reference; vendor kernels
(vllm-flash-attn, flashinfer) are optional, found at run time, and never required.
"""

from __future__ import annotations

import importlib.util

import torch

from strata.kernels.attention_backend import AttentionBackend
from strata.kernels.attention_torch import TorchAttentionBackend


def _vendor_modules() -> dict[str, str]:
    """Vendor backends we know of and the module that would provide each."""
    return {"vllm_flash_attn": "vllm_flash_attn", "flashinfer": "flashinfer"}


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names usable on ``device`` right now. Vendor kernels are listed only once an
    implementation of this interface exists for them and their module imports."""
    dev = torch.device(device)
    names = [TorchAttentionBackend.name] if TorchAttentionBackend.is_available(dev) else []
    return names


def vendor_kernels_importable() -> dict[str, bool]:
    """Which vendor kernel packages are importable in this environment (for diagnostics)."""
    return {name: importlib.util.find_spec(mod) is not None for name, mod in _vendor_modules().items()}


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """Instantiate backend ``name``; ``auto`` picks the best available for ``device``."""
    registry: dict[str, type[AttentionBackend]] = {TorchAttentionBackend.name: TorchAttentionBackend}
    if name == "auto":
        name = available_backends(device)[0]
    if name not in registry:
        known = ", ".join(sorted(set(registry) | set(_vendor_modules())))
        raise ValueError(f"attention backend {name!r} is not available here (known: {known})")
    cls = registry[name]
    if not cls.is_available(torch.device(device)):
        raise ValueError(f"attention backend {name!r} cannot run on {device}")
    return cls()

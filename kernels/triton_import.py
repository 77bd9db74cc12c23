"""Triton is optional (CUDA hosts have it): each Triton kernel module is imported on first use, once."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType
from typing import Any


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def triton_kernel(module: str, name: str) -> tuple[ModuleType, Any]:
    """(triton, the ``@triton.jit`` function ``name`` of ``strata.kernels.<module>``), imported on first use."""
    import triton

    return triton, getattr(importlib.import_module(f"strata.kernels.{module}"), name)

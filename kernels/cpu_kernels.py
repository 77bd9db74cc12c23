"""Build and load Strata's C++ CPU kernels (``csrc/*.cpp``) once per machine, on first use.

The source is compiled with torch's extension builder (g++, ``-O3 -march=native``, OpenMP for ATen's
thread pool) into ``~/.cache/strata/torch_extensions`` (``STRATA_KERNEL_CACHE`` overrides), under a
name that hashes the source, the flags, the torch version and this CPU's feature flags: a cache
shared between machines never hands one CPU another's binary, and an edited source rebuilds.
Building takes ~30 s once; every later process loads the cached library in milliseconds. If the
toolchain is missing or the build fails, :func:`cpu_kernels` returns None (with one warning) and the
torch reference backend is used instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("paged_attention_cpu.cpp", "small_linear_cpu.cpp", "bindings.cpp"))
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)  # resolves to the libgomp torch already loaded (same soname): one OpenMP runtime

_lock = threading.Lock()
_module: ModuleType | None = None
_failed: str | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    digest = hashlib.sha256()
    for src in SOURCES:
        digest.update(src.read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(_cpu_flags().encode())
    return f"strata_cpu_kernels_{digest.hexdigest()[:16]}"


def cache_dir() -> Path:
    root = os.environ.get("STRATA_KERNEL_CACHE") or Path.home() / ".cache" / "strata" / "torch_extensions"
    return Path(root) / build_name()


def cpu_kernels() -> ModuleType | None:
    """The compiled kernels (built on first call), or None when they cannot be built here."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is None and _failed is None:
            try:
                _module = _build()
            except Exception as exc:  # no compiler, a failed build: fall back to the reference backend
                _failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
                log.warning("CPU attention kernels unavailable (%s); using the torch reference backend", _failed)
    return _module


def unavailable_reason() -> str | None:
    return _failed


def _build() -> ModuleType:
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "no CUDA runtime found" on CPU hosts
    from torch.utils.cpp_extension import load

    target = cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    if not (target / f"{target.name}.so").exists():
        log.warning("compiling Strata's CPU attention kernels (once per machine, ~30 s) into %s", target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the builder's notes about CUDA and ninja
        return load(name=target.name, sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS),
                    extra_ldflags=list(LDFLAGS), build_directory=str(target), verbose=False)

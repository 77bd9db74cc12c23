"""Build and load Strata's C++ CPU kernels (``csrc/*.cpp``) once per machine and checkout.

The source is compiled with torch's extension builder (g++, ``-O3 -march=native``, OpenMP for ATen's
thread pool) into ``~/.cache/strata/torch_extensions`` (``STRATA_KERNEL_CACHE`` overrides; the root
is created 0700 because we load native code from it), one directory per :func:`build_name`. The name
hashes everything the build depends on: the sources' contents and resolved paths (torch's build.ninja
records absolute paths, so two checkouts sharing one directory would rebuild each other's library
forever), the flags, the torch version and include paths, the Python version, ABI and include path,
the compiler's identity and this CPU's feature flags. So a shared cache never hands a process a
library built from other sources, for another interpreter or for another CPU.

A library found in its directory is loaded directly (no ninja run, no mtime-triggered rebuild). A
missing one is built under an exclusive ``flock`` on ``<root>/<name>.lock``: processes starting at
once compile once, and the rest wait on the lock and load the result. Building takes ~30 s idle and minutes under
load, so ``make install`` runs ``strata build-kernels`` and no server start pays for it. If the
toolchain is missing or the build fails, :func:`cpu_kernels` returns None (with one warning) and the
torch reference backend is used instead.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("paged_attention_cpu.cpp", "small_linear_cpu.cpp", "amx_linear_cpu.cpp", "quant_linear_cpu.cpp", "dequant_gemm_cpu.cpp",
                          "token_bitmask_cpu.cpp",
                          "layer_ops_cpu.cpp", "delta_rule_cpu.cpp", "sparse_index_cpu.cpp",
                          "bindings.cpp"))
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)  # resolves to the libgomp torch already loaded (same soname): one OpenMP runtime

_lock = threading.Lock()
_module: ModuleType | None = None
_failed: str | None = None
_compiled_here: bool = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.lru_cache(maxsize=None)
def _compiler_identity(cxx: str) -> str:
    """``$CXX`` (what torch's builder runs) and the first line of its ``--version``: a compiler
    upgrade gets a fresh build. Runs once per process; a missing compiler is an identity too."""
    try:
        out = subprocess.run([*shlex.split(cxx), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return f"{cxx}: unavailable ({type(exc).__name__})"
    return f"{cxx}: {(out.splitlines() or [''])[0]}"


def _cpp_extension() -> ModuleType:
    """torch's extension builder, imported without its "no CUDA runtime found" note on CPU hosts."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    import torch.utils.cpp_extension

    return torch.utils.cpp_extension


def _build_inputs() -> list[str]:
    """Everything besides the source bytes that ends up in the build (build.ninja or the binary)."""
    return [
        " ".join(CFLAGS), " ".join(LDFLAGS),
        torch.__version__, *_cpp_extension().include_paths("cpu"),
        sys.version, str(sysconfig.get_config_var("EXT_SUFFIX")), str(sysconfig.get_path("include", scheme="posix_prefix")),
        _compiler_identity(os.environ.get("CXX", "c++")),
        _cpu_flags(),
    ]


def build_name() -> str:
    """A short directory name keyed on every input of the build (see the module docstring)."""
    digest = hashlib.sha256()
    for src in SOURCES:
        digest.update(str(src.resolve()).encode() + b"\0")
        digest.update(src.read_bytes() + b"\0")
    for item in _build_inputs():
        digest.update(item.encode() + b"\0")
    return f"strata_cpu_kernels_{digest.hexdigest()[:16]}"


def cache_root() -> Path:
    return Path(os.environ.get("STRATA_KERNEL_CACHE") or Path.home() / ".cache" / "strata" / "torch_extensions")


def cache_dir() -> Path:
    return cache_root() / build_name()


def library_path() -> Path:
    """Where the built library lives (whether or not it is there yet)."""
    target = cache_dir()
    return target / f"{target.name}.so"


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


def compiled_here() -> bool:
    """Whether this process compiled the library (False: it loaded one already built)."""
    return _compiled_here


@contextmanager
def _build_lock(root: Path, name: str) -> Iterator[None]:
    """Exclusive flock on ``<root>/<name>.lock``: one process builds, concurrent ones wait. The
    kernel drops it if the holder dies, so a killed build never blocks later starts."""
    fd = os.open(root / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process to finish building Strata's CPU kernels (%s)", root / name)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _make_root(root: Path) -> None:
    """The cache root, private to this user (it holds native code we load)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = root.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(root, 0o700)


def _import_library(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build() -> ModuleType:
    global _compiled_here
    root, name = cache_root(), build_name()
    _make_root(root)
    target = root / name
    with _build_lock(root, name):
        library = target / f"{name}.so"
        if library.exists():
            try:
                return _import_library(name, library)  # its name says it matches every input: no rebuild check
            except ImportError as exc:  # e.g. truncated by a build killed while linking: build it again
                log.warning("cached CPU kernels at %s do not load (%s); rebuilding", library, exc)
                library.unlink()
        target.mkdir(exist_ok=True)
        log.warning("compiling Strata's CPU attention kernels (once per machine and checkout: ~30 s, minutes under load) into %s", target)
        _compiled_here = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the builder's notes about CUDA and ninja
            return _cpp_extension().load(name=name, sources=[str(s.resolve()) for s in SOURCES], extra_cflags=list(CFLAGS),
                                         extra_ldflags=list(LDFLAGS), build_directory=str(target), verbose=False)

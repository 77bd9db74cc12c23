"""`strata build-kernels`: compile the C++ CPU kernels now (install time) rather than on the first
server start, where a 1-5 minute compile would sit inside the readiness wait."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the cache location comes from ``STRATA_KERNEL_CACHE`` like at run time."""


def run(args: argparse.Namespace) -> int:
    """One line on stdout, exit 0 either way: a machine without a toolchain still serves (slower)."""
    from strata.kernels import cpu_kernels as ck

    if ck.cpu_kernels() is None:
        print(f"strata: CPU kernels unavailable ({ck.unavailable_reason()}); the torch reference backend will be used")
        return 0
    how = "built now" if ck.compiled_here() else "found cached"
    print(f"strata: CPU kernels {how}: {ck.library_path()}")
    return 0

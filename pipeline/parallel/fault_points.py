"""Named places where a process can be made to fail on purpose, from outside it (fault-injection tests).

Failure paths that only a crash can reach - a tensor-parallel worker whose forward raises mid-step, a
worker loop that dies while its actor lives on - must be tested in the real processes, including the
Ray actors of a served replica, where no test can monkeypatch. With ``STRATA_FAULT_DIR`` set, a file
``<name>.rank<R>`` in that directory makes the next pass of rank R through point ``name`` raise
:class:`InjectedFault`; the file holds how many times (default once) and is consumed. Unset (always,
outside tests), a point costs one environment lookup.

A stall point (:func:`stall_point`) makes work slow instead of failing: a file ``<name>.stall`` holding
seconds makes the next pass through ``name`` sleep that long (consumed). Sleeping burns no core, so a test
can tell where slow work runs (off a loop that must keep streaming, say) without the CPU contention that
real slow work adds on a small host.
"""

from __future__ import annotations

import os
import time

ENV = "STRATA_FAULT_DIR"
_rank = 0


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


def set_fault_rank(rank: int) -> None:
    """Which rank's faults this process takes (tensor-parallel workers; the driver is rank 0)."""
    global _rank
    _rank = rank


def fault_point(name: str, rank: int | None = None) -> None:
    """Raise :class:`InjectedFault` if a fault is armed for this point and rank."""
    if armed(name, rank):
        raise InjectedFault(f"fault injected at {name} on rank {_rank if rank is None else rank}")


def armed(name: str, rank: int | None = None) -> bool:
    """Whether a fault is armed for this point and rank (and consume one): for points where the fault is
    not an exception (a process that crashes or hangs)."""
    root = os.environ.get(ENV)
    if not root:
        return False
    path = os.path.join(root, f"{name}.rank{_rank if rank is None else rank}")
    try:
        with open(path, "r+") as fh:
            text = fh.read().strip()
            left = int(text) - 1 if text.isdigit() else 0
            if left > 0:
                fh.seek(0)
                fh.truncate()
                fh.write(str(left))
    except (FileNotFoundError, ValueError, OSError):
        return False
    if left <= 0:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return True


def stall_point(name: str) -> None:
    """Sleep for the seconds armed for point ``name``, once (see the module)."""
    root = os.environ.get(ENV)
    if not root:
        return
    path = os.path.join(root, f"{name}.stall")
    try:
        with open(path) as fh:
            seconds = float(fh.read().strip() or 0)
        os.unlink(path)
    except (FileNotFoundError, ValueError, OSError):
        return
    time.sleep(max(0.0, seconds))

"""This process's torch thread budget: how many intra-op threads its steps (or an image stage's work) run on."""

from __future__ import annotations

import os
from typing import Callable


def apply_threads(num_threads: int = 0, tp: int = 1) -> Callable[[], None]:
    """Give torch this process's thread budget; returns what puts the previous one back.

    ``num_threads``, or else the cores in this process's affinity mask divided among the ``tp`` ranks.
    The budget is set explicitly either way: Ray gives a replica that reserves no CPUs
    ``OMP_NUM_THREADS=1``, which would leave the model on one core of many. Processes this one
    starts (tensor-parallel workers) inherit the same figure through the environment."""
    import torch

    before, env_before = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    threads = num_threads or max(1, len(os.sched_getaffinity(0)) // tp)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)

    def restore() -> None:
        torch.set_num_threads(before)
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before

    return restore

"""The tensor-parallel group of one stage replica: ``tp`` processes joined by ``torch.distributed``.

Rank 0 is the driver: it schedules, owns the KV tiers and tells the other ranks what to do next with
a command (one broadcast object) before every collective they must join. Gloo on CPU, NCCL on CUDA.
Every collective has a timeout, so a dead worker turns into an error on the driver, never a hang.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0  # a collective inside a step: a peer this late is dead or stuck
IDLE_TIMEOUT = datetime.timedelta(days=365)  # waiting for the next command: idle workers wait indefinitely


@dataclass(frozen=True)
class GroupAddress:
    """Where rank 0 listens for the group's rendezvous (loopback unless the ranks span nodes)."""

    host: str
    port: int

    @staticmethod
    def free_local() -> "GroupAddress":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return GroupAddress("127.0.0.1", s.getsockname()[1])


class TPGroup:
    """This process's membership in a tensor-parallel group (``size`` 1: no group, no communication)."""

    def __init__(self, rank: int = 0, size: int = 1, command_group: Any = None) -> None:
        self.rank = rank
        self.size = size
        self._commands = command_group  # a gloo group without a practical timeout, for commands only
        self.comm_seconds = 0.0  # wall time spent in collectives (the benchmark's communication share)

    @classmethod
    def join(cls, address: GroupAddress, rank: int, size: int, device: str = "cpu",
             timeout_s: float = DEFAULT_TIMEOUT_S) -> "TPGroup":
        """Join (rank > 0) or open (rank 0) the group; blocks until all ``size`` ranks are in."""
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if address.host == "127.0.0.1":  # keep gloo's own sockets on loopback too (it picks the host's IP)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend, init_method=f"tcp://{address.host}:{address.port}", rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank, size, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place (row-parallel outputs, vocab-parallel embeddings)."""
        if self.size > 1:
            with self._timed():
                dist.all_reduce(t)
        return t

    def gather_to_driver(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape) on rank 0, in rank order; None on the other ranks."""
        if self.size == 1:
            return [t]
        t = t.contiguous()
        with self._timed():
            parts = [torch.empty_like(t) for _ in range(self.size)] if self.is_driver else None
            dist.gather(t, parts, dst=0)
        return parts

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` on every rank (in place)."""
        if self.size > 1:
            with self._timed():
                dist.broadcast(t, src=0)
        return t

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's picklable ``obj`` on every rank: how the driver sends commands and step inputs
        (over the command group, so a worker may wait for the next one as long as the stage idles)."""
        if self.size == 1:
            return obj
        box = [obj]
        with self._timed():
            dist.broadcast_object_list(box, src=0, group=self._commands)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's picklable ``obj`` on rank 0, in rank order (load statistics, say)."""
        if self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_driver else None
        dist.gather_object(obj, out, dst=0, group=self._commands)
        return out

    @contextmanager
    def _timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.comm_seconds += time.perf_counter() - t0

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

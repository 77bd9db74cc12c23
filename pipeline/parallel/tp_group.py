"""The tensor-parallel group of one stage replica: ``tp`` processes joined by ``torch.distributed``.

Rank 0 is the driver: it schedules, owns the KV tiers and tells the other ranks what to do next with
a command (one broadcast object) before every collective they must join. The group forms over gloo
(NCCL for tensors on CUDA). On one CPU node the collectives then go through a shared-memory file
(``pipeline.shm_channel``: microseconds instead of gloo's millisecond); anything too big for its
slots, or a group spanning nodes, stays on gloo. Every collective has a timeout, and a dead peer is
an error on the driver at once, never a hang; only a worker waiting for its next command waits
as long as the driver lives.

A step that fails on one rank is abandoned by all of them (:meth:`TPGroup.abandon_step`): on the
shared-memory channel every rank meets the poisoned operation at its next collective and the group
stays in step. A step that had used gloo cannot be abandoned that way (a rank may sit in a gloo
collective no one else joins), so the group is then *broken*: every later step fails at once, and the
replica's health check asks for a new group.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from strata.pipeline.parallel.shm_channel import ABORT, FAILED, ShmChannel

DEFAULT_TIMEOUT_S = 60.0  # a collective inside a step: a peer this late is dead or stuck
IDLE_TIMEOUT = datetime.timedelta(days=365)  # waiting for the next command: idle workers wait indefinitely


@dataclass(frozen=True)
class GroupAddress:
    """Where rank 0 listens for the group's rendezvous (loopback unless the ranks span nodes), and
    the shared-memory file the ranks on rank 0's node use once the group formed."""

    host: str
    port: int
    shm_path: str | None = None
    shm_slot_bytes: int = 0
    store_path: str | None = None  # a loopback group meets through a file, so nothing listens beyond lo

    @staticmethod
    def free_local(host: str = "127.0.0.1", shm_slot_bytes: int = 0) -> "GroupAddress":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        token = uuid.uuid4().hex
        shm = None
        if shm_slot_bytes and platform.machine() in ("x86_64", "AMD64"):  # the channel relies on x86 ordering
            shm = str(root / f"strata-tp-{token}")
        store = str(root / f"strata-tp-store-{token}") if host == "127.0.0.1" else None
        return GroupAddress(host, port, shm, shm_slot_bytes, store)


class TPGroup:
    """This process's membership in a tensor-parallel group (``size`` 1: no group, no communication)."""

    def __init__(self, rank: int = 0, size: int = 1, command_group: Any = None, shm: ShmChannel | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.rank = rank
        self.size = size
        self._commands = command_group  # a gloo group without a practical timeout, for commands only
        self._shm = shm
        self.timeout_s = timeout_s
        self.comm_seconds = 0.0  # wall time spent in collectives (the benchmark's communication share)
        self.broken: str | None = None  # why this group can run no more steps (None: it can)
        self.abandoned_steps = 0  # steps given up by the whole group after a failure on some rank
        self._gloo_in_step = False  # a collective of the current step went over gloo (cannot be abandoned)

    @classmethod
    def join(cls, address: GroupAddress, rank: int, size: int, device: str = "cpu",
             timeout_s: float = DEFAULT_TIMEOUT_S) -> "TPGroup":
        """Join (rank > 0) or open (rank 0) the group; blocks until all ``size`` ranks are in."""
        backend = "nccl" if device.startswith("cuda") else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if address.store_path is not None:  # one node: rendezvous through a file, gloo's sockets on lo
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            if rank == 0:
                os.close(os.open(address.store_path, os.O_CREAT | os.O_WRONLY, 0o600))
            store = dist.FileStore(address.store_path, size)
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        else:  # a TCP store on the driver's node address (the ranks span nodes)
            dist.init_process_group(backend, init_method=f"tcp://{address.host}:{address.port}", rank=rank,
                                    world_size=size, timeout=timeout)
        commands = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        shm = _open_channel(address, rank, size, commands) if device == "cpu" else None
        dist.barrier(group=commands)  # every rank is done with the store: nothing reads it again
        if rank == 0 and address.store_path is not None:
            Path(address.store_path).unlink(missing_ok=True)  # so a killed group leaves nothing behind
        return cls(rank, size, commands, shm, timeout_s)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def transport(self) -> str:
        return "shared memory" if self._shm is not None else "gloo"

    def _on_shm(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes through shared memory (the same answer on every rank: same shapes)."""
        return (self._shm is not None and t.device.type == "cpu" and t.is_contiguous()
                and self._shm.fits(t.numel() * t.element_size()))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place (row-parallel outputs, vocab-parallel embeddings)."""
        if self.size > 1:
            with self._timed():
                if self._on_shm(t):
                    self._shm.all_reduce(t, self.timeout_s)  # type: ignore[union-attr]
                else:
                    self._gloo_in_step = True
                    dist.all_reduce(t)
        return t

    def gather_to_driver(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape) on rank 0, in rank order; None on the other ranks."""
        if self.size == 1:
            return [t]
        t = t.contiguous()
        with self._timed():
            if self._on_shm(t):
                return self._shm.gather(t, self.timeout_s)  # type: ignore[union-attr]
            self._gloo_in_step = True
            wire = _as_bytes(t)
            parts = [torch.empty_like(wire) for _ in range(self.size)] if self.is_driver else None
            dist.gather(wire, parts, dst=0)
        return None if parts is None else [p.view(t.dtype) for p in parts]

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` on every rank (in place)."""
        if self.size > 1:
            with self._timed():
                if self._on_shm(t):
                    self._shm.broadcast(t, self.timeout_s)  # type: ignore[union-attr]
                else:
                    self._gloo_in_step = True
                    dist.broadcast(_as_bytes(t), src=0)  # a view: received in place
        return t

    def broadcast_object(self, obj: Any = None, idle: bool = False) -> Any:
        """Rank 0's picklable ``obj`` on every rank: how the driver sends commands and step inputs.
        ``idle``: a worker waiting for its next command, which waits as long as the driver lives."""
        if self.size == 1:
            return obj
        with self._timed():
            if self._shm is not None:
                sent, value = self._shm.broadcast_object(obj, None if idle else self.timeout_s)
                if sent:
                    return value
            self._gloo_in_step = True
            box = [obj]
            dist.broadcast_object_list(box, src=0, group=self._commands)
        return box[0]

    # ------------------------------------------------------------ failures
    def check_usable(self) -> None:
        """Refuse a step on a broken group (the driver checks before it sends a command)."""
        if self.broken is not None:
            raise RuntimeError(f"the tensor-parallel group is broken ({self.broken})")

    def step_started(self) -> None:
        """Every rank has the step's command: count the step's own gloo collectives from here (the
        command itself may have gone over gloo; it is complete on every rank, so it does not matter)."""
        self._gloo_in_step = False

    def abandon_step(self, reason: str) -> bool:
        """Give up the current step on every rank after it failed here (the driver's forward raised, or
        this worker's did). True if the group is in step again; False if it is now broken (the step
        used gloo, or a peer did not come), and then every later step fails at once."""
        if self.size == 1:
            return True
        if self._shm is None or self._gloo_in_step:
            self.broken = f"a step failed ({reason}) while it used gloo collectives"
            return False
        try:
            with self._timed():
                self._shm.poison(ABORT if self.is_driver else FAILED, self.timeout_s)
        except Exception as exc:  # a peer died or never came: no more steps on this group
            self.broken = f"a step failed ({reason}) and the group could not recover ({exc})"
            return False
        self.abandoned_steps += 1
        return True

    def mark_broken(self, reason: str) -> None:
        self.broken = reason

    def leave_on_error(self) -> None:
        """This rank stops for good on an error: tell the peers at once (they may wait on us), even if
        the process lives on (a Ray actor does)."""
        if self._shm is not None:
            self._shm.mark_gone()

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
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()



def _open_channel(address: GroupAddress, rank: int, size: int, group: Any) -> ShmChannel | None:
    """Rank 0 creates the file, the others open it; used only if every rank could (one node), and
    unlinked as soon as all have it mapped (nothing is left behind, whatever happens later)."""
    if address.shm_path is None:
        return None
    channel = None
    if rank == 0:
        channel = _try(lambda: ShmChannel.create(address.shm_path, size, address.shm_slot_bytes))
    dist.barrier(group=group)
    if rank != 0:  # another node, or no room: gloo it is
        channel = _try(lambda: ShmChannel(address.shm_path, rank, size, address.shm_slot_bytes))
    everyone = torch.tensor([1 if channel is not None else 0])
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
    if rank == 0:
        Path(address.shm_path).unlink(missing_ok=True)
    if not everyone.item() and channel is not None:
        channel.close()
        return None
    return channel


def _try(open_channel: Any) -> ShmChannel | None:
    try:
        return open_channel()
    except OSError:
        return None


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """gloo has no float8 type: an fp8 KV block crosses as its bytes (a view of the same memory)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

"""Collectives of a single-node CPU tensor-parallel group through one shared-memory file.

Gloo over loopback costs about 1 ms per all-reduce on the machine this project is measured on (a
TCP round trip is 17 us), and a decode step runs two per layer; through shared memory it is a few
microseconds. Every operation is the same dance: write my part into my slot of this operation's
buffer, publish the operation's sequence number in my flag, wait until every rank's flag reaches
it, read. Buffers alternate by sequence parity; a rank rewrites a buffer only after it saw every
flag reach the previous operation, which every rank publishes only after it finished reading the
one before, so no slot is overwritten while someone still reads it.

Every operation also publishes its *kind* (all-reduce, gather, broadcast, object) next to its
sequence number, and a rank checks that every peer ran the same kind before it reads: operations are
paired by number, so a rank that fell out of step would otherwise sum a command's bytes into an
all-reduce. Two kinds poison an operation on purpose, which is how a failed step is abandoned by the
whole group without losing step: ``ABORT`` (the driver gives the step up) and ``FAILED`` (a worker's
step raised). A rank that meets one at its next operation raises :class:`StepAborted`; every rank has
then published the same sequence number, so the next command finds the group in step again.

Ordering relies on x86's total store order (the group uses this channel only there). A wait spins
briefly, then sleeps in growing steps (an idle worker costs next to nothing), checks that its peers
are still alive (a dead process, or a rank that marked itself gone before leaving, is an error within
a fraction of a second, not a timeout), and gives up after ``timeout_s`` unless it is the idle wait
for the next command.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import time

import numpy as np
import torch

LINE = 8  # int64s per rank's flag line (one cache line, so ranks never write the same line):
SEQ, KIND_EVEN, KIND_ODD, GONE = 0, 1, 2, 3  # ... its sequence number, the kind of its last even and odd op, gone mark
SPIN_S = 0.002  # busy-wait this long before sleeping (the ranks of a step meet within it)
MAX_SLEEP_S = 0.0005  # inside a step: a rank that is late by a long prefill chunk is not overslept by much
MAX_IDLE_SLEEP_S = 0.005  # waiting for the next command: costs next to nothing while the stage idles
CHECK_PEERS_S = 0.1


ALL_REDUCE, GATHER, BROADCAST, OBJECT, ABORT, FAILED = range(1, 7)
KIND_NAMES = {ALL_REDUCE: "all-reduce", GATHER: "gather", BROADCAST: "broadcast", OBJECT: "object",
              ABORT: "abort", FAILED: "failed step", 0: "nothing"}
POISON = (ABORT, FAILED)


class PeerDiedError(RuntimeError):
    """Another rank of the group is gone (its process exited, or it marked itself gone)."""


class StepAborted(RuntimeError):
    """A rank abandoned the current step (the driver aborted it, or a worker's step failed). The group is
    still in step: the caller drops what it computed and waits for the next command."""


class ChannelDesyncError(RuntimeError):
    """Ranks ran different operations under one sequence number: the group lost step and cannot be
    trusted again (the replica must be replaced)."""


class ShmChannel:
    """One rank's view of the group's shared-memory file (created by rank 0, opened by the rest)."""

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, create: bool = False) -> None:
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        header = 2 * size * LINE * 8  # flags, then pids
        total = header + 2 * size * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, total)
            self._mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        words = np.frombuffer(self._mm, dtype=np.int64, count=2 * size * LINE)
        self._lines = words[: size * LINE].reshape(size, LINE)
        self._flags = self._lines[:, SEQ]
        self._gone = self._lines[:, GONE]
        self._pids = words[size * LINE :: LINE]
        self._pids[rank] = os.getpid()
        raw = torch.frombuffer(self._mm, dtype=torch.uint8, offset=header, count=2 * size * slot_bytes)
        self._slots = raw.view(2, size, slot_bytes)
        self._seq = 0
        self._pidfds: dict[int, int] = {}

    @classmethod
    def create(cls, path: str, size: int, slot_bytes: int) -> "ShmChannel":
        return cls(path, 0, size, slot_bytes, create=True)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    # ------------------------------------------------------------ the dance
    def _slot(self, buf: int, rank: int, t: torch.Tensor) -> torch.Tensor:
        return self._slots[buf, rank].view(t.dtype)[: t.numel()].view(t.shape)

    def _step(self, kind: int, timeout_s: float | None) -> int:
        """Publish the next operation (its kind, then its sequence number) and wait for every rank to
        reach it; the buffer to use. Raises :class:`StepAborted` if a peer poisoned this operation."""
        self._seq += 1
        self._lines[self.rank, KIND_EVEN + self._seq % 2] = kind  # visible before the number (x86 TSO)
        self._flags[self.rank] = self._seq
        self._wait(self._seq, timeout_s)
        self._check_kinds(self._seq, kind)
        return self._seq % 2

    def _begin(self) -> int:
        return (self._seq + 1) % 2  # the buffer the next operation uses (written before publishing)

    def _check_kinds(self, seq: int, kind: int) -> None:
        kinds = self._lines[:, KIND_EVEN + seq % 2]
        if (kinds == kind).all():
            return
        poisoned = [r for r in range(self.size) if kinds[r] in POISON]
        if poisoned:
            if kind in POISON:
                return  # this rank is abandoning the step too
            who = "the driver aborted" if kinds[poisoned[0]] == ABORT else f"rank {poisoned[0]} failed"
            raise StepAborted(f"{who} the tensor-parallel step")
        other = next(r for r in range(self.size) if kinds[r] != kind)
        raise ChannelDesyncError(f"tensor-parallel ranks lost step: rank {other} ran {KIND_NAMES.get(int(kinds[other]), '?')} "
                                 f"where rank {self.rank} ran {KIND_NAMES[kind]} (operation {seq})")

    def _wait(self, seq: int, timeout_s: float | None) -> None:
        flags = self._flags
        if (flags >= seq).all():
            return
        start = time.monotonic()
        next_check = start + CHECK_PEERS_S
        sleep, longest = 0.0, MAX_SLEEP_S if timeout_s is not None else MAX_IDLE_SLEEP_S
        while not (flags >= seq).all():
            now = time.monotonic()
            if now - start > SPIN_S:
                sleep = min(longest, max(sleep * 2, 5e-5))
                time.sleep(sleep)
            if now > next_check:
                next_check = now + CHECK_PEERS_S
                gone = [r for r in range(self.size) if flags[r] < seq and self._gone[r]]
                if gone:
                    raise PeerDiedError(f"tensor-parallel rank {gone[0]} stopped")
                dead = [r for r in range(self.size) if flags[r] < seq and self._exited(r)]
                if dead:
                    raise PeerDiedError(f"tensor-parallel rank {dead[0]} exited")
                if timeout_s is not None and now - start > timeout_s:
                    raise TimeoutError(f"tensor-parallel peers did not arrive within {timeout_s:.0f} s")

    def _exited(self, rank: int) -> bool:
        """Whether a peer's process ended, through a pidfd (readable once the process terminates, zombie
        or not, and immune to pid reuse); ``kill(pid, 0)`` where pidfds are missing."""
        pid = int(self._pids[rank])
        if pid <= 0:
            return False  # not mapped yet
        fd = self._pidfds.get(rank)
        if fd is None:
            try:
                fd = self._pidfds[rank] = os.pidfd_open(pid)
            except ProcessLookupError:
                return True
            except (AttributeError, OSError):  # no pidfd here: existence is all kill(0) can tell
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return True
                except PermissionError:
                    pass
                return False
        return bool(select.select([fd], [], [], 0)[0])

    # ------------------------------------------------------------ failure
    def poison(self, kind: int, timeout_s: float) -> None:
        """Abandon the current step as a group: publish ``kind`` (ABORT from the driver, FAILED from a
        worker) as this rank's next operation and wait until every rank reached it. Ranks still inside
        the step raise :class:`StepAborted` there; ranks already waiting for the next command raise it at
        that wait and wait again. Afterwards every rank is at the same sequence number."""
        assert kind in POISON
        self._step(kind, timeout_s)

    def mark_gone(self) -> None:
        """Tell the peers this rank will take part in nothing more (set before leaving on an error, so a
        peer waiting on it fails at once even though this process may live on, as a Ray actor does)."""
        try:
            self._gone[self.rank] = 1
        except (ValueError, TypeError):  # already unmapped
            pass

    # ------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor, timeout_s: float) -> None:
        """Sum over ranks, in rank order on every rank (so every rank holds identical bits)."""
        buf = self._begin()
        self._slot(buf, self.rank, t).copy_(t)
        self._step(ALL_REDUCE, timeout_s)
        t.copy_(self._slot(buf, 0, t))
        for r in range(1, self.size):
            t.add_(self._slot(buf, r, t))

    def gather(self, t: torch.Tensor, timeout_s: float) -> list[torch.Tensor] | None:
        buf = self._begin()
        self._slot(buf, self.rank, t).copy_(t)
        self._step(GATHER, timeout_s)
        if self.rank:
            return None
        return [self._slot(buf, r, t).clone() for r in range(self.size)]

    def broadcast(self, t: torch.Tensor, timeout_s: float) -> None:
        buf = self._begin()
        if self.rank == 0:
            self._slot(buf, 0, t).copy_(t)
        self._step(BROADCAST, timeout_s)
        if self.rank:
            t.copy_(self._slot(buf, 0, t))

    def broadcast_object(self, obj: object, timeout_s: float | None) -> tuple[bool, object]:
        """(True, rank 0's object), or (False, None) on every rank when it is too big for a slot (the
        caller then sends it another way). ``timeout_s`` None: wait as long as the driver lives."""
        buf = self._begin()
        slot = self._slots[buf, 0]
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            fits = len(data) + 8 <= self.slot_bytes
            slot[:8].view(torch.int64)[0] = len(data) if fits else -1
            if fits:
                slot[8 : 8 + len(data)].numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        self._step(OBJECT, timeout_s)
        n = int(slot[:8].view(torch.int64)[0])
        if n < 0:
            return False, None
        if self.rank == 0:
            return True, obj
        return True, pickle.loads(slot[8 : 8 + n].numpy().tobytes())

    def close(self) -> None:
        self.mark_gone()
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        self._lines = self._flags = self._gone = self._pids = self._slots = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # views still alive: the mapping goes with the process
            pass

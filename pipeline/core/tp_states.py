"""A linear-attention model's per-sequence state under tensor parallelism: each rank holds its heads' part of
every slot (``parallel.linear_shards``), and every change the driver makes outside a step reaches the workers.

Inside a step every rank updates its own part from the step's inputs (the slots are in ``StepInputs``).
Outside one, the driver's state cache zeroes a slot it hands out, copies a state to a snapshot slot or back,
and installs a hand-off's state. The driver's pool makes each change to its own part and logs it; every
worker replays the log, in order, before its next step or state read (``StepInputs.state_ops``), so its
slots hold what the driver's hold, for its heads. A step abandoned by the group has replayed the log on every
rank before its forward, so a retry finds every rank alike. Reading a state out (a hand-off) gathers every
rank's part into the whole model's bytes, the layout one process over all heads gives, so a tp=2 prefill
hands off to a tp=1 decode, and back.
"""

from __future__ import annotations

from typing import Any

import torch

from strata.kvstore.state_pool import StateKind, StatePool
from strata.pipeline.parallel.linear_shards import Cut, LinearShards
from strata.pipeline.parallel.tp_group import TPGroup

StateOp = tuple  # ("zero", slot) | ("copy", source, destination) | ("write", slot, the whole model's bytes)


def _pick(t: torch.Tensor, dim: int, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return torch.cat([t.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim=dim)


class StateShard:
    """The whole model's state layout (``kinds``: the state kinds of all heads) and the part each rank holds."""

    def __init__(self, kinds: tuple[StateKind, ...], num_layers: int, lin: Any, rank: int, size: int) -> None:
        self.kinds = kinds
        self.num_layers = num_layers
        self.rank = rank
        self.cuts: list[dict[str, Cut]] = [LinearShards(lin, r, size).state_cuts() for r in range(size)]

    def bytes_per_sequence(self) -> int:
        return sum(self.num_layers * torch.Size(k.shape).numel() * k.dtype.itemsize for k in self.kinds)

    def _whole(self, data: bytes) -> list[torch.Tensor]:
        """``data`` (every kind's [layers, *shape] in order) as one tensor per kind."""
        flat, start, out = torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, []
        for k in self.kinds:
            n = self.num_layers * torch.Size(k.shape).numel() * k.dtype.itemsize
            out.append(flat[start : start + n].view(k.dtype).view(self.num_layers, *k.shape))
            start += n
        return out

    def local_part(self, data: bytes) -> bytes:
        """This rank's part of a whole state (what its ``StatePool.write`` takes)."""
        cuts = self.cuts[self.rank]
        parts = []
        for k, t in zip(self.kinds, self._whole(data)):
            dim, ranges = cuts[k.name]
            parts.append(_pick(t, dim + 1, ranges).contiguous().view(torch.uint8).reshape(-1))
        return torch.cat(parts).numpy().tobytes()

    def join(self, parts: list[torch.Tensor]) -> bytes:
        """The whole state from every rank's part (uint8, in rank order, each its ``StatePool.read``)."""
        wholes = [torch.empty(self.num_layers, *k.shape, dtype=k.dtype) for k in self.kinds]
        for rank, part in enumerate(parts):
            start = 0
            for k, whole in zip(self.kinds, wholes):
                dim, ranges = self.cuts[rank][k.name]
                shape = list(whole.shape)
                shape[dim + 1] = sum(hi - lo for lo, hi in ranges)
                n = torch.Size(shape).numel() * k.dtype.itemsize
                local = part[start : start + n].cpu().view(k.dtype).view(shape)
                start += n
                at = 0
                for lo, hi in ranges:
                    whole.narrow(dim + 1, lo, hi - lo).copy_(local.narrow(dim + 1, at, hi - lo))
                    at += hi - lo
        return b"".join(w.view(torch.uint8).numpy().tobytes() for w in wholes)


class ShardedStatePool(StatePool):
    """The driver's pool: its own heads' part of every slot, a log of its changes outside steps for the workers,
    and reads and writes of whole states (``StateCache`` and hand-offs see the whole model's bytes)."""

    def __init__(self, kinds: tuple[StateKind, ...], num_layers: int, num_slots: int, device: str | torch.device,
                 num_snapshots: int, group: TPGroup, shard: StateShard) -> None:
        super().__init__(kinds, num_layers, num_slots, device, num_snapshots)
        self.group = group
        self.shard = shard
        self._ops: list[StateOp] = []

    def take_ops(self) -> list[StateOp]:
        """The changes since the last step or read, for the workers to replay (and forgotten here)."""
        ops, self._ops = self._ops, []
        return ops

    def claim(self) -> int | None:
        slot = super().claim()
        if slot is not None:
            self._ops.append(("zero", slot))
        return slot

    def copy(self, src: int, dst: int) -> None:
        super().copy(src, dst)
        self._ops.append(("copy", src, dst))

    def write(self, slot: int, data: bytes) -> None:
        super().write(slot, self.shard.local_part(data))
        self._ops.append(("write", slot, data))

    def read(self, slot: int) -> bytes:
        self.group.broadcast_object(("state_read", (self.take_ops(), slot)))
        parts = self.group.gather_to_driver(_as_bytes(super().read(slot)))
        assert parts is not None
        return self.shard.join(parts)

    def bytes_per_sequence(self) -> int:
        return self.shard.bytes_per_sequence()


def _as_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def replay(pool: StatePool, shard: StateShard, ops: list[StateOp]) -> None:
    """A worker applies the driver's changes to its own part of the slots, in order."""
    for op in ops:
        if op[0] == "zero":
            for t in pool.tensors.values():
                t[op[1]].zero_()
        elif op[0] == "copy":
            pool.copy(op[1], op[2])
        elif op[0] == "write":
            pool.write(op[1], shard.local_part(op[2]))
        else:
            raise RuntimeError(f"unknown state operation {op[0]!r}")


def serve_state_read(group: TPGroup, pool: StatePool, shard: StateShard, arg: tuple[list[StateOp], int]) -> None:
    """A worker's side of :meth:`ShardedStatePool.read`: catch up with the driver, send its part of the slot."""
    ops, slot = arg
    replay(pool, shard, ops)
    group.gather_to_driver(_as_bytes(pool.read(slot)))

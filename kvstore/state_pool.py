"""The per-sequence state cache group of linear-attention layers: fixed-size state in slots, one per sequence.

A linear-attention layer (Gated DeltaNet) caches no per-token KV: it keeps, per sequence, its causal
convolution's last inputs and its recurrent matrix. Their size does not grow with the context, so they
live outside the block pool, in slots: a sequence claims one when it first reserves KV and gives it
back when its blocks are freed (finished, failed or preempted), so a running sequence always has one
and a recompute starts from a zeroed state. There are ``max_num_seqs`` slots at least, so a slot never
limits what the pool admits. Each kind of state is one tensor ``[slots, layers, *shape]`` in its own
dtype (the recurrent matrix in fp32, as the reference keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateKind:
    """One kind of per-sequence state every linear layer keeps: its name, per-layer shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class StatePool:
    """Slots of per-sequence state for ``num_layers`` linear layers: ``num_slots`` for running sequences,
    claimed zeroed and released by the KV cache, and ``num_snapshots`` more that hold states at block
    boundaries for prefix reuse (``state_snapshots``). The two never borrow from each other, so a snapshot
    never keeps a sequence from running."""

    def __init__(self, kinds: tuple[StateKind, ...], num_layers: int, num_slots: int,
                 device: str | torch.device = "cpu", num_snapshots: int = 0) -> None:
        if num_slots <= 0 or num_layers <= 0 or num_snapshots < 0:
            raise ValueError(f"a state pool needs slots and layers, got {num_slots} slots of {num_layers} layers")
        self.kinds = kinds
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        total = num_slots + num_snapshots
        self.tensors = {k.name: torch.zeros(total, num_layers, *k.shape, dtype=k.dtype, device=device) for k in kinds}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._free_snapshots = list(range(total - 1, num_slots - 1, -1))
        self._claimed: set[int] = set()

    def bytes_per_sequence(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    @property
    def num_free(self) -> int:
        return len(self._free)

    def claim(self) -> int | None:
        """A zeroed slot for a sequence starting (None when every slot is held)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._claimed.add(slot)
        for t in self.tensors.values():
            t[slot].zero_()
        return slot

    def claim_snapshot(self) -> int | None:
        """A snapshot slot, its contents undefined until copied into (None when every one is held)."""
        if not self._free_snapshots:
            return None
        slot = self._free_snapshots.pop()
        self._claimed.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._claimed:
            raise ValueError(f"state slot {slot} is not claimed")
        self._claimed.remove(slot)
        (self._free if slot < self.num_slots else self._free_snapshots).append(slot)

    def copy(self, src: int, dst: int) -> None:
        """Every layer's state of slot ``src`` into slot ``dst``."""
        for t in self.tensors.values():
            t[dst].copy_(t[src])

    def read(self, slot: int) -> bytes:
        """Slot ``slot``'s state, every kind and layer in order, as bytes (what a hand-off ships)."""
        return b"".join(t[slot].contiguous().view(torch.uint8).numpy().tobytes() for t in self.tensors.values())

    def write(self, slot: int, data: bytes) -> None:
        """Slot ``slot``'s state from bytes of :meth:`read` (``bytes_per_sequence`` of them)."""
        flat, start = torch.frombuffer(bytearray(data), dtype=torch.uint8), 0
        for t in self.tensors.values():
            part = t[slot]
            n = part.numel() * part.element_size()
            part.copy_(flat[start : start + n].view(part.dtype).view(part.shape))
            start += n

    def layer(self, name: str, layer: int) -> torch.Tensor:
        """Kind ``name`` of linear layer ``layer`` for every slot: [slots, *shape] (a view)."""
        return self.tensors[name][:, layer]

    def stats(self) -> dict[str, int]:
        running = sum(1 for s in self._claimed if s < self.num_slots)
        return {"slots": self.num_slots, "in_use": running, "snapshot_slots": self.num_snapshots,
                "snapshots_in_use": len(self._claimed) - running, "bytes_per_sequence": self.bytes_per_sequence()}

    def check_invariants(self) -> None:
        """Every slot is free or claimed, never both, never twice, and free in its own list."""
        free = set(self._free) | set(self._free_snapshots)
        assert len(free) == len(self._free) + len(self._free_snapshots), "a state slot is free twice"
        assert not free & self._claimed, "a state slot is free and claimed"
        assert free | self._claimed == set(range(self.num_slots + self.num_snapshots)), "a state slot is lost"
        assert all(s < self.num_slots for s in self._free), "a snapshot slot is on the running list"
        assert all(s >= self.num_slots for s in self._free_snapshots), "a running slot is on the snapshot list"

"""Per-sequence mapping from token positions to KV blocks, spilled and resident."""

from __future__ import annotations

from dataclasses import dataclass, field


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens (the last one possibly partial)."""
    return -(-num_tokens // block_size)


def chunk_working_set_blocks(chunk_tokens: int, block_size: int) -> int:
    """Device blocks one prefill chunk needs when older blocks may live in a lower tier: the chunk's
    blocks plus one it may straddle. The least a device pool must keep free for a prompt to progress."""
    return blocks_for_tokens(chunk_tokens, block_size) + 1


@dataclass(eq=False)
class BlockTable:
    """One sequence's blocks: how many tokens are written, which logical blocks are published
    (full, hashed, shareable) and where each block lives.

    Logical block ``i`` covers token positions ``[i * block_size, (i + 1) * block_size)``.
    The first ``num_spilled`` logical blocks are not on the device: they live in a lower tier,
    addressed by ``hashes[i]``. ``block_ids[j]`` is the device block of logical block
    ``num_spilled + j``. ``hashes`` holds the hash of every published block, so
    ``num_published == len(hashes) >= num_spilled``.

    Only the KV store (``TieredKVCache``) changes a table. It does so in two ways besides
    appending, both between steps on the thread that owns the pool, never while a step reads
    the table: *publishing* may swap a block id for the id of an identical cached block (same
    hash, so the same tokens after the same prefix: attention reads the same values), and the
    duplicate is released only after the swap; *spilling* moves leading published blocks off the
    device (``block_ids`` loses its head, ``num_spilled`` grows), and those blocks stay readable
    by hash through the lower tiers, pinned for this table until it is freed.
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_spilled: int = 0
    hashes: list[bytes] = field(default_factory=list)
    # per sliding-window group (by group index): the first logical block the table still reads there. It
    # holds that group's claim (``WindowSlots``) on each resident block from there on; never below num_spilled
    window_starts: dict[int, int] = field(default_factory=dict)
    # a linear-attention model's per-sequence state (``state_pool``): the slot a step reads and the one it
    # writes, swapped when the step succeeds (a failed step leaves the state as it was); -1: none held
    state_slot: int = -1
    state_spare: int = -1
    # its state at the latest block boundary it crossed (``state_snapshots``): slot, and blocks before it
    snapshot_slot: int = -1
    snapshot_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.num_tokens > self.capacity():
            raise ValueError("num_tokens exceeds the capacity of block_ids")

    @property
    def num_published(self) -> int:
        return len(self.hashes)

    @property
    def num_blocks(self) -> int:
        """Logical blocks held, spilled ones included."""
        return self.num_spilled + len(self.block_ids)

    def capacity(self) -> int:
        """Tokens the current blocks can hold."""
        return self.num_blocks * self.block_size

    @property
    def first_resident_token(self) -> int:
        """Position of the first token whose KV is on the device."""
        return self.num_spilled * self.block_size

    def num_full_blocks(self, num_tokens: int | None = None) -> int:
        """Blocks whose every slot is written (only these may be hashed/published)."""
        return (self.num_tokens if num_tokens is None else num_tokens) // self.block_size

    def blocks_needed(self, new_num_tokens: int) -> int:
        """Extra blocks required to hold ``new_num_tokens`` tokens in total."""
        return max(0, blocks_for_tokens(new_num_tokens, self.block_size) - self.num_blocks)

    def slot(self, position: int) -> int:
        """The flat slot id (block_id * block_size + offset) of one resident token position (a decode)."""
        bs = self.block_size
        return self.block_ids[position // bs - self.num_spilled] * bs + position % bs

    def slots(self, start: int, end: int) -> list[int]:
        """Flat slot ids (block_id * block_size + offset) for token positions [start, end)."""
        if not self.first_resident_token <= start <= end <= self.capacity():
            raise IndexError(f"range [{start}, {end}) outside resident blocks [{self.first_resident_token}, {self.capacity()})")
        bs, skip = self.block_size, self.num_spilled
        return [self.block_ids[p // bs - skip] * bs + p % bs for p in range(start, end)]

    def window_floor(self) -> int:
        """Blocks before this one are read by no windowed group (all of them when there is none)."""
        return min(self.window_starts.values(), default=self.num_blocks)

    def is_empty(self) -> bool:
        return not self.block_ids and self.num_spilled == 0

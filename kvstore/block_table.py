"""Per-sequence mapping from token positions to pool blocks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockTable:
    """Per-sequence list of block ids plus how many tokens are written; knows which blocks are full.

    The first ``num_spilled`` logical blocks are not on the device (they live in a lower
    tier, addressed by hash); ``block_ids[j]`` holds logical block ``num_spilled + j``.
    """

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_spilled: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.num_tokens > self.capacity():
            raise ValueError("num_tokens exceeds the capacity of block_ids")

    def capacity(self) -> int:
        """Tokens the current blocks can hold."""
        return (self.num_spilled + len(self.block_ids)) * self.block_size

    @property
    def first_resident_token(self) -> int:
        """Position of the first token whose KV is on the device."""
        return self.num_spilled * self.block_size

    def num_full_blocks(self) -> int:
        """Blocks whose every slot is written (only these may be hashed/published)."""
        return self.num_tokens // self.block_size

    def blocks_needed(self, new_num_tokens: int) -> int:
        """Extra blocks required to hold ``new_num_tokens`` tokens in total."""
        needed = -(-new_num_tokens // self.block_size)
        return max(0, needed - self.num_spilled - len(self.block_ids))

    def slots(self, start: int, end: int) -> list[int]:
        """Flat slot ids (block_id * block_size + offset) for token positions [start, end)."""
        if not self.first_resident_token <= start <= end <= self.capacity():
            raise IndexError(f"range [{start}, {end}) outside resident blocks [{self.first_resident_token}, {self.capacity()})")
        bs, skip = self.block_size, self.num_spilled
        return [self.block_ids[p // bs - skip] * bs + p % bs for p in range(start, end)]

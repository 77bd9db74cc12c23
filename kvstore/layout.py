"""Shape and size of one KV-cache block, shared by every tier of the store.

Kept model-agnostic: callers describe the attention geometry (layers, KV heads,
head dim) and the store never needs to know which model produced it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}
_ITEMSIZE: dict[torch.dtype, int] = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def dtype_name(dtype: torch.dtype) -> str:
    """Stable string for a supported dtype (used in hashes and msgpack payloads)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype: {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype name: {name!r}") from None


@dataclass(frozen=True)
class KVLayout:
    """Geometry of the paged KV cache; one block holds K and V of every layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        dtype_name(self.dtype)  # validates

    def block_shape(self) -> tuple[int, ...]:
        """(num_layers, 2, block_size, num_kv_heads, head_dim); index 0/1 on dim 1 is K/V."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    def bytes_per_token(self) -> int:
        """K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_size

    def to_dict(self) -> dict[str, Any]:
        """msgpack-friendly representation (dtype as its name)."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "dtype": dtype_name(self.dtype),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        return cls(
            num_layers=int(d["num_layers"]),
            num_kv_heads=int(d["num_kv_heads"]),
            head_dim=int(d["head_dim"]),
            block_size=int(d["block_size"]),
            dtype=dtype_from_name(d["dtype"]),
        )

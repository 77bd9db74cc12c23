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
    "float8_e4m3fn": torch.float8_e4m3fn,  # an FP8 KV cache (``kv_cache_dtype: fp8``): tiers move its bytes as they are
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}
_ITEMSIZE: dict[torch.dtype, int] = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float8_e4m3fn: 1}


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
    """Geometry of the paged KV cache; one block holds what attention caches for every layer.

    ``kv_parts`` is 2 for K and V (MHA/GQA: ``num_kv_heads`` heads of ``head_dim`` each) and 1 for a
    single tensor that serves as both (MLA: one "head" holding the compressed latent and the shared
    RoPE key, ``kv_lora_rank + qk_rope_head_dim`` values). Tiers, block files and hashing only see the
    geometry, so they hold either kind unchanged."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    kv_parts: int = 2

    def __post_init__(self) -> None:
        if self.kv_parts not in (1, 2):
            raise ValueError(f"kv_parts must be 1 (a latent) or 2 (K and V), got {self.kv_parts}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        dtype_name(self.dtype)  # validates

    def block_shape(self) -> tuple[int, ...]:
        """(num_layers, kv_parts, block_size, num_kv_heads, head_dim); on dim 1, index 0 is K and -1 is V
        (the same tensor when ``kv_parts`` is 1)."""
        return (self.num_layers, self.kv_parts, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    def bytes_per_token(self) -> int:
        """What one token caches across all layers."""
        return self.kv_parts * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

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
            "kv_parts": self.kv_parts,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        return cls(
            num_layers=int(d["num_layers"]),
            num_kv_heads=int(d["num_kv_heads"]),
            head_dim=int(d["head_dim"]),
            block_size=int(d["block_size"]),
            dtype=dtype_from_name(d["dtype"]),
            kv_parts=int(d.get("kv_parts", 2)),
        )

"""Shape and size of one KV-cache block, shared by every tier of the store: the model's cache groups.

Kept model-agnostic: a model declares its groups (which layers, how many KV heads of what width, which
dtype, which window) and the store never needs to know which model produced them.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace
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
class CacheGroup:
    """Layers that cache the same thing per token, in one geometry and dtype.

    ``kv_parts`` is 2 for K and V (MHA/GQA: ``num_kv_heads`` heads of ``head_dim`` each) and 1 for a
    single tensor that serves as both (MLA: one "head" holding the compressed latent and the shared
    RoPE key, ``kv_lora_rank + qk_rope_head_dim`` values). ``window`` is the sliding window every layer
    of the group attends over (None: the whole context). ``compress`` > 1 caches one row per that many
    tokens (DeepSeek-V4's pooled entries: entry ``w`` sits in the block holding token ``(w + 1) m - 1``), so
    a block holds ``block_size / compress`` rows, or one when the block is shorter than ``compress`` tokens.
    Tiers, block files and hashing see only the geometry, so they hold any group unchanged."""

    layers: tuple[int, ...]  # model layer indices, ascending
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    kv_parts: int = 2
    window: int | None = None
    compress: int = 1

    def __post_init__(self) -> None:
        if self.kv_parts not in (1, 2):
            raise ValueError(f"kv_parts must be 1 (a latent) or 2 (K and V), got {self.kv_parts}")
        if not self.layers or list(self.layers) != sorted(set(self.layers)) or self.layers[0] < 0:
            raise ValueError(f"a cache group's layers must be distinct, ascending and non-negative: {self.layers}")
        for name in ("num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"a sliding window must be positive, got {self.window}")
        if self.compress < 1 or (self.compress > 1 and self.window is not None):
            raise ValueError(f"a compressed group caches the whole context once per {self.compress} tokens: "
                             f"compress must be >= 1 and has no window")
        dtype_name(self.dtype)  # validates

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def rows(self, block_size: int) -> int:
        """Rows one block holds: a token each, or a compressed group's entries."""
        return max(1, block_size // self.compress)

    def layer_shape(self, block_size: int) -> tuple[int, int, int, int]:
        """One layer of one block: (kv_parts, rows, num_kv_heads, head_dim), rows being ``block_size`` unless
        the group is compressed; index 0 of dim 0 is K and -1 is V (the same tensor when ``kv_parts`` is 1)."""
        return (self.kv_parts, self.rows(block_size), self.num_kv_heads, self.head_dim)

    def layer_nbytes(self, block_size: int) -> int:
        return self.kv_parts * self.rows(block_size) * self.num_kv_heads * self.head_dim * _ITEMSIZE[self.dtype]

    def with_heads(self, num_kv_heads: int) -> CacheGroup:
        return replace(self, num_kv_heads=num_kv_heads)

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "dtype": dtype_name(self.dtype), "kv_parts": self.kv_parts, "window": self.window,
                "compress": self.compress}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheGroup:
        window = d.get("window")
        return cls(tuple(int(i) for i in d["layers"]), int(d["num_kv_heads"]), int(d["head_dim"]),
                   dtype_from_name(d["dtype"]), int(d["kv_parts"]), None if window is None else int(window),
                   int(d.get("compress", 1)))


@dataclass(frozen=True)
class KVLayout:
    """Geometry of the paged KV cache: one block holds ``block_size`` tokens of every cache group.

    Every model layer belongs to exactly one group. A block's bytes (what the tiers store, hash and
    hand off) are its groups in order, each group's layers in order; that order is the block's *slots*
    (``slot_of``), so one layer is still one contiguous byte range of a block file."""

    groups: tuple[CacheGroup, ...]
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not self.groups:
            raise ValueError("a KV layout needs at least one cache group")
        layers = sorted(i for g in self.groups for i in g.layers)
        if layers != list(range(len(layers))):
            raise ValueError(f"cache groups must cover layers 0..{len(layers) - 1} once each, got {layers}")
        for g in self.groups:
            if g.compress > 1 and self.block_size % g.compress and g.compress % self.block_size:
                raise ValueError(f"block_size {self.block_size} and a group compressed {g.compress}:1 must divide "
                                 "one another")

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16,
                dtype: torch.dtype = torch.float32, kv_parts: int = 2) -> KVLayout:
        """One group holding every layer alike (every full-attention model)."""
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        return cls((CacheGroup(tuple(range(num_layers)), num_kv_heads, head_dim, dtype, kv_parts),), block_size)

    @property
    def num_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)

    @functools.cached_property
    def _slots(self) -> tuple[tuple[int, int], ...]:
        """(group, index in group) of every slot, in block byte order."""
        return tuple((gi, j) for gi, g in enumerate(self.groups) for j in range(g.num_layers))

    @functools.cached_property
    def _slot_of_layer(self) -> tuple[int, ...]:
        slot = {layer: s for s, (gi, j) in enumerate(self._slots) for layer in [self.groups[gi].layers[j]]}
        return tuple(slot[i] for i in range(self.num_layers))

    def slot_of(self, layer: int) -> int:
        """Where model layer ``layer`` sits in a block's bytes."""
        return self._slot_of_layer[layer]

    def group_of(self, layer: int) -> tuple[int, int]:
        """(group index, index inside the group) of model layer ``layer``."""
        return self._slots[self.slot_of(layer)]

    @functools.cached_property
    def window_groups(self) -> tuple[int, ...]:
        """Indices of the sliding-window groups (each keeps its own device slots: ``window_slots``)."""
        return tuple(gi for gi, g in enumerate(self.groups) if g.window is not None)

    @functools.cached_property
    def layer_meta(self) -> tuple[int, ...]:
        """Per model layer, which step metadata it reads: 0 for a full-attention group, ``1 + k`` for the
        k-th sliding-window group (``AttentionMetadata.by_layer``)."""
        order = {gi: 1 + k for k, gi in enumerate(self.window_groups)}
        return tuple(order.get(self.group_of(i)[0], 0) for i in range(self.num_layers))

    @functools.cached_property
    def slot_offsets(self) -> tuple[int, ...]:
        """Byte offset of each slot in a block, plus the block's size at the end."""
        sizes = [self.groups[gi].layer_nbytes(self.block_size) for gi, _ in self._slots]
        return tuple(itertools.accumulate(sizes, initial=0))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype every group stores (an FP8 cache is FP8 in every group)."""
        dtypes = {g.dtype for g in self.groups}
        if len(dtypes) != 1:
            raise ValueError(f"cache groups differ in dtype: {sorted(dtype_name(d) for d in dtypes)}")
        return next(iter(dtypes))

    def bytes_per_token(self) -> int:
        """What one token caches across all layers (a compressed group's share of its block)."""
        return self.bytes_per_block() // self.block_size

    def bytes_per_block(self) -> int:
        return self.slot_offsets[-1]

    def per_rank(self, tp: int) -> KVLayout:
        """The layout one rank of a tensor-parallel group holds: each group's KV heads split ``tp`` ways
        (a group with fewer heads than ranks keeps one head per rank, replicated)."""
        return replace(self, groups=tuple(g.with_heads(max(1, g.num_kv_heads // tp)) for g in self.groups))

    def to_dict(self) -> dict[str, Any]:
        """msgpack-friendly representation (dtypes as names)."""
        return {"block_size": self.block_size, "groups": [g.to_dict() for g in self.groups]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        return cls(tuple(CacheGroup.from_dict(g) for g in d["groups"]), int(d["block_size"]))

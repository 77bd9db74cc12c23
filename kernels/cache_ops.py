"""Writing new keys/values (or MLA latents) into the paged cache."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # the largest finite e4m3 value: an fp8 cache saturates there (values arrive over their scale)


def write_cache(
    cache: torch.Tensor,
    values: torch.Tensor,
    slot_mapping: torch.Tensor,
    slot_blocks: torch.Tensor | None = None,
    slot_offsets: torch.Tensor | None = None,
) -> None:
    """Scatter ``values`` ([T, H, D]) to flat slots of a cache shaped [blocks, block_size, H, D].

    The cache may be a strided view of the block-major pool (one layer of it), so the write
    indexes block and offset separately instead of flattening. ``slot_blocks``/``slot_offsets``
    are that split, when the caller computed it once for every layer of the step.
    """
    if slot_blocks is None or slot_offsets is None:
        block_size = cache.shape[1]
        slot_blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        slot_offsets = slot_mapping - slot_blocks * block_size
    if cache.dtype == torch.float8_e4m3fn:
        values = values.clamp(-FP8_MAX, FP8_MAX)  # past it e4m3 has no finite value
    cache[slot_blocks, slot_offsets] = values.to(cache.dtype)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    slot_blocks: torch.Tensor | None = None,
    slot_offsets: torch.Tensor | None = None,
) -> None:
    """:func:`write_cache` of keys and of values."""
    write_cache(k_cache, k, slot_mapping, slot_blocks, slot_offsets)
    write_cache(v_cache, v, slot_mapping, slot_blocks, slot_offsets)

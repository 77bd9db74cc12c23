"""Writing new keys/values into the paged cache."""

from __future__ import annotations

import torch


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    slot_blocks: torch.Tensor | None = None,
    slot_offsets: torch.Tensor | None = None,
) -> None:
    """Scatter ``k``/``v`` ([T, Hkv, D]) to flat slots of caches shaped [blocks, block_size, Hkv, D].

    The caches may be strided views of the block-major pool (one layer of it), so the write
    indexes block and offset separately instead of flattening. ``slot_blocks``/``slot_offsets``
    are that split, when the caller computed it once for every layer of the step.
    """
    if slot_blocks is None or slot_offsets is None:
        block_size = k_cache.shape[1]
        slot_blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        slot_offsets = slot_mapping - slot_blocks * block_size
    k_cache[slot_blocks, slot_offsets] = k.to(k_cache.dtype)
    v_cache[slot_blocks, slot_offsets] = v.to(v_cache.dtype)

"""Writing new keys/values into the paged cache."""

from __future__ import annotations

import torch


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``k``/``v`` ([T, Hkv, D]) to flat slots of caches shaped [blocks, block_size, Hkv, D].

    The caches may be strided views of the block-major pool (one layer of it), so the
    write indexes block and offset separately instead of flattening.
    """
    block_size = k_cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - blocks * block_size
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)

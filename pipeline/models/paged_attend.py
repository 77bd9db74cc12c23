"""One layer's attention over the paged KV cache: the part every attention module shares.

Strata's own ``decoder.Attention`` and the transformers fallback's attention function
(``models.fallback_model``) both end here, so chunked prefill, prefix reuse, spilled tiers, sinks and
an FP8 cache behave the same whichever module computed q, k and v.
"""

from __future__ import annotations

import torch

from strata.kernels import AttentionBackend, AttentionMetadata, attend_spilled, write_kv
from strata.kernels.sinks import apply_sinks


def paged_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: list[torch.Tensor], layer_idx: int,
                 meta: AttentionMetadata, backend: AttentionBackend, scale: float, sliding_window: int | None = None,
                 sinks: torch.Tensor | None = None, kv_scales: tuple[float, float] | None = None) -> torch.Tensor:
    """Write this step's k/v ([T, Hkv, D]) into layer ``layer_idx`` of the pool (``kv``: each layer's
    [blocks, 2, block_size, Hkv, D] view of its cache group), attend q ([T, Hq, D]) over it and over spilled
    blocks: [T, Hq, D]. ``kv_scales`` (FP8): store k / s_k and v / s_v, attend with
    q * s_k, scale the output by s_v."""
    meta = meta.for_layer(layer_idx)  # a sliding-window group reads its own slots
    k_cache, v_cache = kv[layer_idx][:, 0], kv[layer_idx][:, 1]
    if kv_scales is not None:
        s_k, s_v = kv_scales
        k, v, q = k / s_k, v / s_v, q * s_k
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.slot_blocks, meta.slot_offsets)
    spilled = meta.spilled is not None
    out, lse = backend.forward(q, k_cache, v_cache, meta, scale, sliding_window,
                               return_lse=spilled or sinks is not None)
    if spilled:
        out = attend_spilled(q, out, lse, meta, layer_idx, scale, sliding_window)
    if sinks is not None:
        out = apply_sinks(out, lse, sinks)
    if kv_scales is not None:
        out = out * kv_scales[1]
    return out.contiguous()  # one layout whatever the backend (compiled steps guard on strides)

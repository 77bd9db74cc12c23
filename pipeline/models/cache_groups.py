"""Which cache groups a language model declares: its layers split by the window they attend over.

Every group caches the attention kind's geometry (K and V per KV head, or MLA's one latent). Full-attention
layers form the first group and each sliding window its own, so a model whose layers all attend alike
(every model before gpt-oss) has one group, and gpt-oss has two: its full layers and its 128-token windows.
DeepSeek-V3.2 adds a group of its own for DSA's indexer keys (one small vector per token and layer).
DeepSeek-V4 has no per-token full group at all (``compressed_groups``).
"""

from __future__ import annotations

import torch

from strata.kvstore.layout import CacheGroup, KVLayout
from strata.pipeline.models.text_config import TextConfig


def cache_groups(text: TextConfig, dtype: torch.dtype) -> tuple[CacheGroup, ...]:
    """Full-attention layers first, then one group per distinct window (smallest first). An MTP layer
    run as a drafter (``models.mtp``) attends over the whole context: it joins the first group."""
    if text.compressed is not None:
        return compressed_groups(text, dtype)
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(text.kv_layer_windows + (None,) * text.mtp_layers):  # KV-layout indices
        by_window.setdefault(window, []).append(layer)
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    groups = tuple(CacheGroup(tuple(by_window[w]), text.kv_cache_heads, text.kv_cache_dim, dtype, text.kv_parts, w)
                   for w in order)
    if text.dsa is not None:  # DSA's indexer keys: one small vector per token and attention layer, after the latents
        first = text.cached_layers
        groups += (CacheGroup(tuple(range(first, first + text.index_layers)), 1, text.dsa.head_dim, dtype, 1),)
    return groups


def kv_layout(text: TextConfig, block_size: int, dtype: torch.dtype) -> KVLayout:
    """The block geometry the model caches, group by group."""
    return KVLayout(cache_groups(text, dtype), block_size)


def compressed_groups(text: TextConfig, dtype: torch.dtype) -> tuple[CacheGroup, ...]:
    """DeepSeek-V4: per compression rate the pooled entries (a row per ``rate`` tokens over the whole context: the
    full groups, first), then per CSA rate its indexer keys alike (a group of their own, so they can be read, and
    kept on the device, without the entries), then every layer's sliding window of K=V, then per rate the
    compressor's per-token projections, kept only as long as a window that has not closed may pool them."""
    c = text.compressed
    assert c is not None
    layers = len(c.compress)
    entries = tuple(CacheGroup(tuple(c.entry_layer(i) for i in c.layers_at(r)), 1, c.head_dim, dtype, 1, None, r)
                    for r in c.rates)
    keys = tuple(CacheGroup(tuple(c.index_layer(i) for i in c.layers_at(r)), 1, c.index_dim, dtype, 1, None, r)
                 for r in c.rates if c.is_sparse(r))
    window = CacheGroup(tuple(range(layers)), 1, c.head_dim, dtype, 1, c.window)
    projections = tuple(CacheGroup(tuple(c.projection_layer(i) for i in c.layers_at(r)), 1, c.projection_width(r),
                                   dtype, 1, c.projection_window(r)) for r in c.rates)
    return entries + keys + (window,) + projections


def mirrored_groups(text: TextConfig) -> tuple[int, ...]:
    """The groups a step reads whole, which the device keeps copies of for spilled blocks while they fit
    (``kvstore.layer_mirror``): DSA's indexer keys (its last group); DeepSeek-V4's indexer keys and its HCA
    layers' entries (one per 128 tokens, every one attended). () for other models."""
    if text.dsa is not None:
        return (len(cache_groups(text, torch.float32)) - 1,)
    c = text.compressed
    if c is None:
        return ()
    dense = tuple(k for k, r in enumerate(c.rates) if not c.is_sparse(r))
    return dense + tuple(range(len(c.rates), len(c.rates) + sum(c.is_sparse(r) for r in c.rates)))

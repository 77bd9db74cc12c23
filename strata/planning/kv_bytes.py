"""What a model caches, per token and per sequence: the planner's side of the KV layout and the state pool.

Full-attention layers cache per token; sliding-window layers a fixed window of slots (``kvstore.window_slots``);
linear-attention layers (Qwen3-Next's Gated DeltaNet) no tokens at all, but a fixed state per sequence
(``kvstore.state_pool``): two running copies (the one a step reads, the one it writes) and, with prefix
caching, a snapshot slot. DeepSeek-V4 caches per block a row per ``m`` tokens of its compressed layers (a row per
block when blocks are shorter than ``m``), and a fixed window of KV and of the compressor's projections.
"""

from __future__ import annotations

from strata.kvstore.window_slots import slots_for_window
from strata.pipeline.models.text_config import TextConfig

STATE_COPIES = 3  # per sequence: the state a step reads, the one it writes, its snapshot (``kvstore.state_cache``)


def kv_bytes_per_token(tc: TextConfig, elem_bytes: int) -> int:
    """What one token caches over the layers whose cache grows with the context: K and V, 2 x layers x kv_heads
    x head_dim x dtype bytes; MLA's one latent, layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes.
    Sliding-window layers keep a fixed window instead (:func:`window_kv_bytes`), unless every layer slides
    (then, as the engine does, they are counted as full); linear-attention layers a state per sequence
    (:func:`linear_state_bytes`). DSA (DeepSeek-V3.2) adds its indexer key per token and layer."""
    if tc.compressed is not None:  # per block, rows of entries (``kv_bytes_per_block``); this is a 128-token block's
        return kv_bytes_per_block(tc, elem_bytes, 128) // 128
    index = tc.dsa.head_dim * elem_bytes * tc.index_layers if tc.dsa is not None else 0
    return _per_layer_token(tc, elem_bytes) * (tc.num_layers - sum(tc.linear_layers) - len(sliding_layers(tc))) + index


def kv_bytes_per_block(tc: TextConfig, elem_bytes: int, block_size: int) -> int:
    """What one block caches over the layers whose cache grows with the context (DeepSeek-V4: its pooled entries,
    ``max(1, block_size / m)`` rows of each compressed layer)."""
    c = tc.compressed
    if c is None:
        return kv_bytes_per_token(tc, elem_bytes) * block_size
    width = {r: c.head_dim + (c.index_dim if c.is_sparse(r) else 0) for r in c.rates}  # an entry, and a CSA key
    return sum(len(c.layers_at(r)) * max(1, block_size // r) * width[r] * elem_bytes for r in c.rates)


def window_kv_bytes(tc: TextConfig, elem_bytes: int, block_size: int, concurrency: int, chunk_tokens: int,
                    blocks_needed: int) -> int:
    """Device bytes of the sliding-window layers' slots (``kvstore.window_slots``): ``concurrency`` windows
    and one step's tokens, whatever the context (never more than ``blocks_needed`` blocks' worth)."""
    if tc.compressed is not None:
        return sum(width * elem_bytes * block_size * layers
                   * min(blocks_needed, slots_for_window(window, block_size, concurrency, chunk_tokens))
                   for window, width, layers in compressed_windows(tc))
    per_block = _per_layer_token(tc, elem_bytes) * block_size
    return sum(per_block * tc.layer_windows.count(w)
               * min(blocks_needed, slots_for_window(w, block_size, concurrency, chunk_tokens))
               for w in set(sliding_layers(tc)))


def compressed_windows(tc: TextConfig) -> list[tuple[int, int, int]]:
    """DeepSeek-V4's windowed caches as (window, values per token, layers): every layer's window of K=V, and each
    compression's projections, kept until the windows they pool close (``models.cache_groups``)."""
    c = tc.compressed
    assert c is not None
    return [(c.window, c.head_dim, len(c.compress))] + [
        (c.projection_window(r), c.projection_width(r), len(c.layers_at(r))) for r in c.rates]


def _per_layer_token(tc: TextConfig, elem_bytes: int) -> int:
    return tc.kv_parts * tc.kv_cache_heads * tc.kv_cache_dim * elem_bytes


def sliding_layers(tc: TextConfig) -> list[int]:
    """Each sliding layer's window, when some layers attend over the whole context (a hybrid)."""
    windows = [w for w in tc.layer_windows if w is not None]
    return windows if len(windows) < tc.num_layers else []


def linear_state_bytes(tc: TextConfig, elem_bytes: int) -> int:
    """One sequence's linear-attention state over every linear layer, as the engine holds it
    (``STATE_COPIES`` copies); 0 for a model without such layers."""
    if tc.linear is None:
        return 0
    return STATE_COPIES * sum(tc.linear_layers) * tc.linear.state_bytes(elem_bytes)


def sparse_read_bytes(tc: TextConfig, elem_bytes: int, context_tokens: int) -> tuple[int, int]:
    """What one decode step of a DSA model reads, per sequence: (every indexer key of the context, kept on the
    device as ``kvstore.layer_mirror`` keeps them; the latents of the ``index_topk`` chosen tokens, from
    wherever they live); DeepSeek-V4's: (its indexer keys and HCA entries; its chosen CSA entries and its windows).
    (0, 0) for a model without sparse attention."""
    c = tc.compressed
    if c is not None:  # V4: (every CSA indexer key and every HCA entry, kept on the device; the chosen CSA entries and
        # the windows)
        sparse = [i for i, s in enumerate(c.sparse) if s and c.compress[i]]
        dense = [i for i, s in enumerate(c.sparse) if not s and c.compress[i]]
        whole = (sum(context_tokens // c.compress[i] for i in sparse) * c.index_dim
                 + sum(context_tokens // c.compress[i] for i in dense) * c.head_dim) * elem_bytes
        chosen = (len(sparse) * min(c.index_topk, context_tokens) + len(c.compress) * min(c.window, context_tokens)
                  ) * c.head_dim * elem_bytes
        return whole, chosen
    if tc.dsa is None:
        return 0, 0
    keys = context_tokens * tc.index_layers * tc.dsa.head_dim * elem_bytes
    attention_layers = tc.num_layers - sum(tc.linear_layers)  # every one reads its chosen latents
    return keys, min(tc.dsa.topk, context_tokens) * attention_layers * tc.kv_cache_dim * elem_bytes

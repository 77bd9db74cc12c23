"""Which decoder layers route to experts: each family's rule, read from its config keys.

The rule belongs to the family, not to its router: GLM-4.5 routes like DeepSeek-V3 and keeps its
dense-layer keys, while MiniMax-M2 routes like it with every layer sparse.
"""

from __future__ import annotations

from typing import Any, Callable

SparseLayerRule = Callable[[dict[str, Any], int], tuple[bool, ...]]


def every_layer(tc: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Mixtral, gpt-oss, MiniMax-M2: no dense layer."""
    return (True,) * layers


def first_k_dense(tc: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """DeepSeek-V3 and its kin: the first ``first_k_dense_replace`` layers dense, then every
    ``moe_layer_freq``-th layer sparse."""
    first, freq = int(tc.get("first_k_dense_replace") or 0), int(tc.get("moe_layer_freq") or 1)
    return tuple(i >= first and i % freq == 0 for i in range(layers))


def sparse_step(tc: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Qwen-MoE: every ``decoder_sparse_step``-th layer sparse, except those in ``mlp_only_layers``."""
    skip, step = set(tc.get("mlp_only_layers") or ()), int(tc.get("decoder_sparse_step") or 1)
    return tuple(i not in skip and (i + 1) % step == 0 for i in range(layers))

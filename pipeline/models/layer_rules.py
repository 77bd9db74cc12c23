"""A family's per-layer rules, read from its config keys: which layers route to experts, and which attend
within a sliding window.

The sparse-layer rule belongs to the family, not to its router: GLM-4.5 routes like DeepSeek-V3 and keeps
its dense-layer keys, while MiniMax-M2 routes like it with every layer sparse.
"""

from __future__ import annotations

from typing import Any, Callable

SparseLayerRule = Callable[[dict[str, Any], int], tuple[bool, ...]]
WindowRule = Callable[[dict[str, Any], int], tuple["int | None", ...]]
LinearLayerRule = Callable[[dict[str, Any], int], tuple[bool, ...]]


def linear_by_type(tc: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Qwen3-Next: ``layer_types`` say which layers are linear attention; without them, every
    ``full_attention_interval``-th layer attends fully and the others are linear."""
    types = tc.get("layer_types")
    if types is not None:
        if len(types) != layers:
            from strata.pipeline.models.config_errors import ModelConfigError

            raise ModelConfigError(f"config.json: layer_types has {len(types)} entries for {layers} layers")
        return tuple(t == "linear_attention" for t in types)
    interval = int(tc.get("full_attention_interval") or 4)
    return tuple((i + 1) % interval != 0 for i in range(layers))


def kda_layers(tc: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Kimi-Linear: ``layer_types`` (as transformers saves it), else the release's ``linear_attn_config``
    lists of ``kda_layers`` and ``full_attn_layers`` (counted from 1), else transformers' default: every
    4th layer but the first attends fully."""
    if tc.get("layer_types") is not None:
        return linear_by_type(tc, layers)
    nested = tc.get("linear_attn_config") or {}
    if "kda_layers" in nested and "full_attn_layers" in nested:
        kda, full = set(nested["kda_layers"]), set(nested["full_attn_layers"])
        if kda & full or kda | full != set(range(1, layers + 1)):
            from strata.pipeline.models.config_errors import ModelConfigError

            raise ModelConfigError(f"config.json: linear_attn_config's kda_layers and full_attn_layers must split "
                                   f"layers 1..{layers} between them")
        return tuple(i + 1 in kda for i in range(layers))
    return tuple(not (i and i % 4 == 0) for i in range(layers))


def typed_mlp_layers(tc: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Kimi-Linear: ``mlp_layer_types`` (dense / sparse, as transformers saves it), else DeepSeek's
    ``first_k_dense_replace`` (1 when absent, transformers' default) and ``moe_layer_freq``."""
    types = tc.get("mlp_layer_types")
    if types is not None:
        if len(types) != layers:
            from strata.pipeline.models.config_errors import ModelConfigError

            raise ModelConfigError(f"config.json: mlp_layer_types has {len(types)} entries for {layers} layers")
        return tuple(t == "sparse" for t in types)
    return first_k_dense({"first_k_dense_replace": 1, **tc}, layers)


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


def no_window(tc: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Every layer attends over the whole context."""
    return (None,) * layers


def one_window(tc: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Mistral, Mixtral: one ``sliding_window`` for every layer, when the config sets one."""
    window = tc.get("sliding_window")
    return (None,) * layers if window is None else (int(window),) * layers


def _typed(tc: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    window = tc.get("sliding_window")
    if window is None:
        return (None,) * layers
    types = tc.get("layer_types") or ["full_attention"] * layers
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def typed_windows_if_enabled(tc: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Qwen2/3: ``layer_types`` say which layers slide, only when ``use_sliding_window`` is on."""
    return _typed(tc, layers) if tc.get("use_sliding_window", False) else (None,) * layers


def typed_windows(tc: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """gpt-oss: its ``layer_types`` alone say which layers slide."""
    return _typed(tc, layers)

"""The transformers fallback's config: a causal LM no Strata family implements, read from generic keys.

vLLM calls this path its Transformers modeling backend: an architecture transformers implements, whose
attention goes through transformers' attention interface, runs with transformers' own modules for its
layers while its attention calls Strata's paged attention (``models.fallback_model``). What Strata needs
to know before loading anything is only what sizes the KV cache and the engine: layers, heads, head size,
vocabulary and context. Those keys are common to every decoder config; the layers' own options are
transformers' business. What the fallback cannot serve is refused here in one line, before a weight is read.
"""

from __future__ import annotations

from typing import Any

from strata.pipeline.models.architectures import CAUSAL_LM_NAMES, ModelArchitecture
from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.text_config import TextConfig

MODEL_IMPLS = ("auto", "strata", "transformers")  # vLLM's --model-impl (its "vllm" is our "strata")
FALLBACK_WHERE = "transformers' modules for every layer, Strata's paged attention inside them"


def transformers_causal_lm(model_type: object) -> str | None:
    """The transformers causal-LM class of ``model_type``, or None when transformers has none."""
    if not isinstance(model_type, str):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def fallback_architecture(raw: dict[str, Any]) -> ModelArchitecture | None:
    """The fallback's architecture for a config.json transformers implements as a causal LM; None otherwise.
    A composite model (a vision tower, a nested text config) is refused: its image stages are Strata's own."""
    cls = transformers_causal_lm(raw.get("model_type"))
    if cls is None:
        return None
    if raw.get("vision_config") is not None or raw.get("text_config") is not None:
        raise ModelConfigError(f"{cls} is a composite model (a vision tower or a nested text config): the "
                               "transformers fallback serves text-only causal LMs")
    return ModelArchitecture(cls, str(raw["model_type"]), CAUSAL_LM_NAMES, fallback=True)


def fallback_text_config(raw: dict[str, Any]) -> TextConfig:
    """What the engine needs of the decoder, from the keys every transformers decoder config shares. The
    probe forward at load (``models.fallback_model``) checks the KV shapes against what the layers compute."""
    if raw.get("quantization_config"):
        raise ModelConfigError("the transformers fallback serves unquantized checkpoints only: this one has a "
                               "quantization_config")
    heads = _positive(raw, "num_attention_heads")
    hidden = _positive(raw, "hidden_size")
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    if not isinstance(kv_heads, int) or not isinstance(head_dim, int) or kv_heads <= 0 or head_dim <= 0:
        raise ModelConfigError("num_key_value_heads and head_dim must be positive integers")
    layers = _positive(raw, "num_hidden_layers")
    eps = raw.get("rms_norm_eps", raw.get("layer_norm_eps", raw.get("norm_epsilon", 1e-6)))
    return TextConfig(
        model_type=str(raw["model_type"]),
        vocab_size=_positive(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size") or 0),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(eps),
        rope_parameters=dict(raw.get("rope_parameters") or {}),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
        attention_bias=False,
        o_bias=False,
        mlp_bias=False,
        layer_windows=(None,) * layers,  # each layer passes its own window to the attention call
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def _positive(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"config.json's {key} must be a positive integer, got {value!r}")
    return value


def check_fallback_engine(config: Any) -> None:
    """The engine options the fallback cannot honour, refused in one line (``config``: an EngineConfig)."""
    if config.tp > 1:
        raise ModelConfigError("the transformers fallback does not split across tensor-parallel ranks: use tp 1")
    if config.compile:
        raise ModelConfigError("compile is not supported on the transformers fallback (its layers are "
                               "transformers' modules, not Strata's compiled steps)")
    if config.kv_cache_dtype != "auto":
        raise ModelConfigError("an FP8 KV cache is not supported on the transformers fallback (its scales are "
                               "calibrated on Strata's own attention modules): use kv_cache_dtype auto")

"""Multi-token prediction (DeepSeek-V3, GLM-4.5): the checkpoint's layer past the decoder, run as a drafter.

DeepSeek-V3 trains one extra layer (``model.layers.{num_hidden_layers}``) to predict the token after next:
at position i it reads the main model's final hidden state h_i and the embedding of token i+1, joins them
(``eh_proj`` over ``[enorm(embed), hnorm(h)]``), runs one decoder layer of the family (MLA and MoE) over
its own KV cache, and its head predicts token i+2. Served, that is a one-token draft per step, verified
by the model itself, so output is exact whatever the drafter says (``core.speculation.verify``).

The layer caches KV like any other, so it is one more layer of the model's full-attention cache group:
its blocks are hashed, spilled, handed off and adopted with the rest. The embedding and the output head
are the model's own: the paper shares them, and the copies releases store beside the layer
(``embed_tokens``, ``shared_head.head``) are left unread. As vLLM does, the embedding at position 0 is
zeroed (the first token has no prediction behind it) and h is the final-normed hidden state.

The layer's module is ``models.decoder.MTPLayer``; this module decides when a load runs it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from strata.pipeline.models.config_errors import ModelConfigError

if TYPE_CHECKING:
    from strata.pipeline.models.model_config import ModelConfig


def with_mtp(cfg: ModelConfig, method: str | None) -> ModelConfig:
    """``cfg`` with its MTP layer on when speculative decoding asks for ``mtp``; a model without one, or one
    whose drafter this engine does not run, is refused in one line."""
    if method != "mtp":
        return cfg
    text = cfg.text
    if text.nextn_layers < 1:
        raise ModelConfigError(f"speculative method mtp needs a checkpoint with multi-token-prediction layers "
                               f"(num_nextn_predict_layers in config.json); this {text.model_type} has none: "
                               "use ngram")
    if text.mla is None and text.model_type != "glm4_moe":
        raise ModelConfigError(f"speculative method mtp runs DeepSeek-V3-style MTP layers (DeepSeek-V3, Kimi-K2, "
                               f"GLM-4.5), not {text.model_type}'s")
    if cfg.arch.fallback or cfg.takes_images or text.uses_mrope or any(w is not None for w in text.layer_windows):
        raise ModelConfigError("speculative method mtp runs on Strata's own text models without sliding windows")
    return replace(cfg, text=replace(text, mtp_layers=1))


def check_mtp_engine(tp: int, kv_cache_dtype: str) -> None:
    """What the MTP drafter does not run with yet, refused before anything loads."""
    if tp > 1:
        raise ModelConfigError("speculative method mtp runs with tp=1 only (a tensor-parallel drafter is not "
                               "implemented): use ngram, or tp=1")
    if kv_cache_dtype != "auto":
        raise ModelConfigError("speculative method mtp needs kv_cache_dtype auto (the MTP layer's FP8 scales "
                               "are not calibrated)")

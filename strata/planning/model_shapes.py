"""Named model shapes the planner knows without a checkpoint: the sizes Strata is built to serve.

``moe-1t`` is the trillion-parameter MoE backbone this project targets, in the Mixtral family our
decoder runs: Kimi-K2's published dimensions (61 layers, hidden 7168, 64 heads, 384 experts of
intermediate 2048 with 8 routed per token, a 160K vocabulary), with grouped-query attention on
8 KV heads in place of K2's latent attention. About 1.04 T parameters.
"""

from __future__ import annotations

from typing import Any

BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "moe-1t": {
        "model_type": "mixtral",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_local_experts": 384,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 50000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
}

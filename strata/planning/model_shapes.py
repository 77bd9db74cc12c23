"""Named model shapes the planner knows without a checkpoint: the sizes Strata is built to serve.

``kimi-k2`` is the trillion-parameter MoE backbone this project targets, as Moonshot publishes its
``config.json``: a DeepSeek-V3 architecture with 61 layers (the first dense), hidden 7168, 64 MLA heads
over a 512 + 64 latent, 384 routed experts of intermediate 2048 with 8 per token and one shared
expert, a 160K vocabulary and yarn RoPE (factor 32 over 4K) to 128K. About 1.03 T parameters, and
61 x 576 x 2 B = 70,272 bytes of KV per token in bf16. ``deepseek-v3`` is its 671 B sibling. Both are
released in FP8 with 128 x 128 block scales, and their configs say so; ``kimi-k2-thinking`` is Kimi-K2
with INT4 routed experts (compressed-tensors groups of 32; attention, shared experts, dense MLPs and the
LM head left in bf16), as Moonshot ships Kimi-K2-Thinking. ``moe-1t`` is kept as another name for
``kimi-k2`` (it used to be a GQA stand-in). ``gpt-oss-120b`` is OpenAI's hybrid: half its layers attend over
128-token windows, its experts ship in MXFP4.
"""

from __future__ import annotations

from typing import Any

_DEEPSEEK_V3_COMMON: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}

KIMI_INT4_EXPERTS = {  # Kimi-K2-Thinking's and Kimi-K2.5's quantization_config, as published
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "actorder": None}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
}

BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "kimi-k2": {
        **_DEEPSEEK_V3_COMMON,
        "vocab_size": 163840,
        "n_routed_experts": 384,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.827,
        "max_position_embeddings": 131072,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "rope_theta": 50000.0,
    },
    "deepseek-v3": {
        **_DEEPSEEK_V3_COMMON,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "vocab_size": 129280,
        "n_routed_experts": 256,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "rope_theta": 10000.0,
    },
}
BUILTIN_SHAPES["kimi-k2-thinking"] = {**BUILTIN_SHAPES["kimi-k2"], "quantization_config": KIMI_INT4_EXPERTS}
BUILTIN_SHAPES["moe-1t"] = BUILTIN_SHAPES["kimi-k2"]
BUILTIN_SHAPES["deepseek-v3.2"] = {  # DeepSeek-V3.2(-Exp) as released: V3's shape plus DSA's lightning indexer
    **BUILTIN_SHAPES["deepseek-v3"],
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}
BUILTIN_SHAPES["gpt-oss-120b"] = {  # as OpenAI publishes its config.json: 36 layers, every other one a 128-token window
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "vocab_size": 201088,
    "attention_bias": True,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "rms_norm_eps": 1e-5,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}
BUILTIN_SHAPES["kimi-linear-48b"] = {  # as Moonshot publishes Kimi-Linear-48B-A3B's config.json: KDA + NoPE MLA
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
    "vocab_size": 163840,
    "model_max_length": 1048576,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
BUILTIN_SHAPES["qwen3-next-80b"] = {  # as Qwen publishes Qwen3-Next-80B-A3B's config.json: 3 of 4 layers linear
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "vocab_size": 151936,
    "max_position_embeddings": 262144,
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

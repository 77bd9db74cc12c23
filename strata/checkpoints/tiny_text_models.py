"""Tiny text-only checkpoints of every registered decoder family, made by transformers' own classes.

Each is ``AutoModelForCausalLM.from_config`` on a small config of that family, saved with
``save_pretrained`` (sharded safetensors, config, generation config) next to a locally trained
tokenizer with a plain chat template. The configs vary what real checkpoints vary: tied embeddings
and llama3 RoPE (Llama, as SmolLM2), a sliding window (Mistral), q/k/v biases (Qwen2), a head dim
apart from hidden/heads with q/k norm (Qwen3), softmax MoE with and without renormalisation and
dense layers between sparse ones (Mixtral, Qwen3-MoE), for DeepSeek-V3 MLA with or without a
q LoRA, interleaved yarn RoPE with mscale, sigmoid group-limited routing, shared experts and a
first dense layer, for gpt-oss sinks, alternating sliding and full layers and clamped-SwiGLU experts, and
for MiniMax-M2 q/k norms over all heads, a quarter of each head rotated and sigmoid routing over every
expert. The same builder makes the families the transformers fallback serves (``FALLBACK_ARCHITECTURES``)
and Qwen3-Next, which it refuses, and Kimi-Linear. ``overrides`` change any config field (tests build variants with them).
"""

from __future__ import annotations

import copy

from pathlib import Path
from typing import Any

from strata.checkpoints.tiny_model import INIT_RANGE, ROPE_THETA, SPECIAL_TOKENS, BOS, EOS, PAD, train_tokenizer, write_sha256sums

TEXT_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss",
                      "minimax_m2", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear",
                      "deepseek_v32", "glm_moe_dsa", "deepseek_v4")
# Architectures with no Strata family, served on the transformers fallback (``models.fallback_model``)
FALLBACK_ARCHITECTURES = ("ernie4_5_moe", "hunyuan_v1_moe", "seed_oss", "glm4")

# "<s>user: Hi\nassistant: Hello</s>\n...assistant:" (content is a string, as text models' templates read it)
TEXT_CHAT_TEMPLATE = (
    "{{- '<s>' -}}"
    "{%- for message in messages -%}"
    "{{- message['role'] + ': ' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- '</s>' -}}{%- endif -%}{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant:' -}}{%- endif -%}"
)

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=4096, initializer_range=INIT_RANGE,
               rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, tie_word_embeddings=False)

_FAMILY: dict[str, dict[str, Any]] = {
    "llama": dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 100000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512}),
    "mistral": dict(sliding_window=48),
    "qwen2": dict(),
    "qwen3": dict(head_dim=32),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=False, mlp_only_layers=[1], num_hidden_layers=3),
    "deepseek_v3": dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": ROPE_THETA, "factor": 4.0,
                                         "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 1.0, "mscale_all_dim": 1.0}),
    # GLM-4.5 as released: q/k/v biases, no q/k norm, RoPE over half of each head, DeepSeek-V3's router
    "glm4_moe": dict(num_hidden_layers=3, head_dim=32, attention_bias=True, use_qk_norm=False, moe_intermediate_size=32,
                     n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
                     first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                     rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.5}),
    # gpt-oss as released, small: sliding and full layers alternating (a window of 12 cuts blocks and prefill
    # chunks), sinks, biases everywhere, a top-2 router over 4 clamped-SwiGLU experts, yarn without truncation
    "gpt_oss": dict(num_hidden_layers=3, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=12,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"], attention_bias=True,
                    rope_parameters={"rope_type": "yarn", "rope_theta": ROPE_THETA, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 1024}),
    # MiniMax-M2 as released, small: q/k norms over all heads, RoPE over a quarter of each head (its releases
    # say ``rotary_dim``), sigmoid routing with a correction bias over every expert of every layer
    "minimax_m2": dict(head_dim=32, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, rotary_dim=8,
                       rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}),
    # The fallback's families vary what their releases vary: ERNIE-4.5's biased linears and dense first layer
    # before the experts, Hunyuan's q/k norms after RoPE, Seed-OSS's q/k/v biases, GLM-4's extra norms around
    # attention and MLP with RoPE over half of each head in interleaved pairs
    "ernie4_5_moe": dict(num_hidden_layers=3, head_dim=16, use_bias=True, moe_num_experts=4, moe_k=2,
                         moe_intermediate_size=32, moe_layer_start_index=1),
    "hunyuan_v1_moe": dict(head_dim=16, num_experts=4, moe_topk=2, moe_intermediate_size=32),
    "seed_oss": dict(head_dim=16, attention_bias=True),
    "glm4": dict(head_dim=16, partial_rotary_factor=0.5),
    # Qwen3-Next: Gated DeltaNet linear attention in 3 of every 4 layers, gated attention in the 4th (the
    # transformers fallback refuses it: its state is no paged KV; Strata's own family runs it)
    "qwen3_next": dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32),
    # Qwen3.5 (text): the same layers with the linear projections apart; dense, and every layer sparse
    "qwen3_5_text": dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16),
    "qwen3_5_moe_text": dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=32),
    # Kimi-Linear: KDA in 3 of 4 layers, MLA without positions in the 3rd, a first dense layer, then
    # DeepSeek-V3's group-limited sigmoid routing with a shared expert (transformers saves the release's names)
    "kimi_linear": dict(num_hidden_layers=4, num_key_value_heads=4, intermediate_size=96, kv_lora_rank=32,
                        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, linear_head_dim=16,
                        linear_num_heads=4, layer_types=["linear_attention", "linear_attention", "full_attention",
                                                         "linear_attention"],
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5),
    # DeepSeek-V3.2: DeepSeek-V3 with DSA; an indexer of 2 heads keeps 8 tokens, far fewer than a prompt holds,
    # and with two ReLU'd heads a quarter of the scores are exactly 0, so the top-8 boundary often falls in a tie
    "deepseek_v32": dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                         q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                         n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
                         first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=8,
                         index_head_dim=16, index_n_heads=2),
    # GLM-5: the same with the indexer's RoPE in pairs, and its third layer reusing the second's top-k
    # (transformers reads index_topk_freq / index_skip_topk_offset as full, full, shared, full)
    "glm_moe_dsa": dict(num_hidden_layers=4, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=8,
                        index_head_dim=16, index_n_heads=2, index_topk_freq=2, index_skip_topk_offset=2),
    # DeepSeek-V4: a 16-token window, CSA (4:1, an indexer keeping 4 entries) and HCA (16:1) layers beside a
    # sliding-only one, 4 mHC streams, the first two layers routed by token id
    "deepseek_v4": dict(num_hidden_layers=4, head_dim=32, num_key_value_heads=1, q_lora_rank=32, o_groups=2,
                        o_lora_rank=16, partial_rotary_factor=0.25, sliding_window=16, n_routed_experts=8,
                        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, index_n_heads=2,
                        index_head_dim=16, index_topk=4, hc_mult=4, num_nextn_predict_layers=0,
                        layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                     "sliding_attention", "compressed_sparse_attention"],
                        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                        rope_parameters=None),
}


def make_text_config(arch: str, vocab: int, overrides: dict[str, Any] | None = None):
    """The transformers config of a tiny ``arch`` (a registered text family)."""
    from transformers import AutoConfig

    if arch not in _FAMILY:
        raise ValueError(f"unknown text architecture {arch!r}; expected one of {', '.join(TEXT_ARCHITECTURES)}")
    # a copy: a config class may write into the dicts it is given (Qwen3-Next adds its partial_rotary_factor to
    # rope_parameters), which must not reach the next family's config
    fields = copy.deepcopy({**_COMMON, **_FAMILY[arch], **(overrides or {})})
    return AutoConfig.for_model(arch, vocab_size=vocab, bos_token_id=SPECIAL_TOKENS.index(BOS),
                                eos_token_id=SPECIAL_TOKENS.index(EOS), pad_token_id=SPECIAL_TOKENS.index(PAD), **fields)


def perturb_params(model, seed: int) -> None:
    """Nonzero biases (routing biases included), non-one norms, and DeepSeek-V4's sinks, mHC bases and token-id
    routing table (transformers starts them at zero) filled, so code that drops any of them fails tests."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("bias") and tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * INIT_RANGE)
            elif name.endswith(("sinks", ".base", "hc_base")) and not tensor.any():  # DeepSeek-V4's start at zero
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * INIT_RANGE)
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hash layers: distinct experts per token id
                experts = int(model.config.n_routed_experts)
                tensor.copy_(torch.stack([torch.randperm(experts, generator=gen)[: tensor.shape[1]]
                                          for _ in range(tensor.shape[0])]))
            elif "norm" in name and name.endswith(".weight"):
                tensor.copy_(torch.empty(tensor.shape).uniform_(0.5, 1.5, generator=gen))


def save_tiny_vlm(model_class, config, out_dir: Path, seed: int, text: dict[str, Any]) -> None:
    """Instantiate a composite transformers model with fixed seeds, perturb it, and save it as 200 KB shards
    with a greedy generation config (the tiny VLM builders' shared last steps)."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    perturb_params(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=text["bos_token_id"], eos_token_id=text["eos_token_id"],
                                               pad_token_id=text["pad_token_id"], do_sample=False)
    model.save_pretrained(out_dir, max_shard_size="200KB")


def build_tiny_text_model(arch: str, out_dir: str | Path, seed: int = 0, overrides: dict[str, Any] | None = None,
                          max_shard_size: str = "200KB", tool_format: str | None = None) -> Path:
    """Write a complete offline-loadable text-only checkpoint of ``arch`` into ``out_dir``; with
    ``tool_format`` its chat template renders tools and calls in that family's syntax
    (``tiny_tool_templates``)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(512, 4096)
    tok.chat_template = TEXT_CHAT_TEMPLATE
    if tool_format is not None:
        from strata.checkpoints.tiny_tool_templates import add_tool_template

        add_tool_template(tok, tool_format)
    config = make_text_config(arch, len(tok), overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb_params(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id, do_sample=False)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    tok.save_pretrained(out_dir)
    write_sha256sums(out_dir)
    return out_dir

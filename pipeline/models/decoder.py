"""Llama-family decoder (Llama, Mistral, Qwen2, Mixtral) over the paged KV cache.

Tokens of all sequences in a step are flattened to [T, hidden]; attention reads and
writes the block pool through :class:`kernels.AttentionMetadata`.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.kernels import AttentionBackend, AttentionMetadata, RotaryEmbedding, apply_rope, attend_spilled, rms_norm, write_kv
from strata.pipeline.model_config import TextConfig
from strata.pipeline.models.mlp import DenseMLP, SparseMoE


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.layer_windows[layer_idx]
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, k, cos, sin)
        k_cache, v_cache = kv[:, self.layer_idx, 0], kv[:, self.layer_idx, 1]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        spilled = meta.spilled is not None
        out, lse = backend.forward(q, k_cache, v_cache, meta, self.scale, self.sliding_window, return_lse=spilled)
        if spilled:
            out = attend_spilled(q, out, lse, meta, self.layer_idx, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(cfg) if cfg.num_experts else DenseMLP(cfg)

    def forward(self, x, cos, sin, kv, meta, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LanguageModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head of a Llama-family model."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Run all layers over flattened token embeddings [T, hidden]; returns final-normed hidden [T, hidden]."""
        cos, sin = self.rope.cos_sin(positions, embeds.dtype)
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, kv, meta, backend)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

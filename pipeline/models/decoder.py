"""Llama-family decoder (Llama, Mistral, Qwen2, Mixtral) over the paged KV cache.

Tokens of all sequences in a step are flattened to [T, hidden]; attention reads and
writes the block pool through :class:`kernels.AttentionMetadata`.

The modules keep the checkpoint's parameter names (``q_proj``, ``gate_proj``, ...) so weights load
by name; after loading, :meth:`LanguageModel.fuse_projections` concatenates q/k/v and gate/up into
one matrix each (the per-projection weights become views of it) so a layer runs two GEMMs fewer.
The hot path calls ``F.linear`` and the layers' ``forward`` directly: on a small model, per-op
and per-module Python overhead is a large share of a decode step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import (
    AttentionBackend, AttentionMetadata, RotaryEmbedding, attend_spilled, rms_norm, rotate_heads, signed_sin, write_kv,
)
from strata.pipeline.model_config import TextConfig
from strata.pipeline.models.mlp import DenseMLP, SparseMoE, fuse_rows


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
        self.qkv_weight: torch.Tensor | None = None  # set by fuse_projections
        self.qkv_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        self.qkv_weight, self.qkv_bias = fuse_rows(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_weight is not None:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(t, hq + 2 * hkv, d)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).view(t, hq + 2 * hkv, d)
        qk = rotate_heads(qkv[:, : hq + hkv], cos, sin)  # q and k heads rotated in one pass
        q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]
        k_cache, v_cache = kv[:, self.layer_idx, 0], kv[:, self.layer_idx, 1]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.slot_blocks, meta.slot_offsets)
        spilled = meta.spilled is not None
        out, lse = backend.forward(q, k_cache, v_cache, meta, self.scale, self.sliding_window, return_lse=spilled)
        if spilled:
            out = attend_spilled(q, out, lse, meta, self.layer_idx, self.scale, self.sliding_window)
        return F.linear(out.reshape(t, hq * d), self.o_proj.weight, self.o_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(cfg) if cfg.num_experts else DenseMLP(cfg)

    def forward(self, x, cos, sin, kv, meta, backend) -> torch.Tensor:
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        x = x + self.self_attn.forward(rms_norm(x, ln1.weight, ln1.eps), cos, sin, kv, meta, backend)
        return x + self.mlp.forward(rms_norm(x, ln2.weight, ln2.eps))


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

    def fuse_projections(self) -> None:
        """After loading: one q/k/v matrix and one gate/up matrix per layer (weights become views)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            if isinstance(layer.mlp, DenseMLP):
                layer.mlp.fuse()

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
        sin_signed = signed_sin(sin)
        x = embeds
        for layer in self.layers:
            x = layer.forward(x, cos, sin_signed, kv, meta, backend)
        return rms_norm(x, self.norm.weight, self.norm.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.weight).float()

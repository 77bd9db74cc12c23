"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged cache of compressed latents.

Per token and layer the cache holds one vector: the normed compressed KV ``c`` (``kv_lora_rank``
values) and the shared RoPE key ``k_pe`` (``qk_rope_head_dim``), 576 values for DeepSeek-V3 instead of
128 heads x (192 + 128) expanded. Attention runs in the weight-absorbed form, as DeepSeek's and vLLM's
decoders do: ``kv_b_proj`` splits per head into ``W_UK`` (latent -> no-RoPE key) and ``W_UV`` (latent ->
value); since ``q_nope . (W_UK c) = (W_UK^T q_nope) . c``, each query head is folded into latent space
once, attends to the cached vectors directly as an MQA with one KV "head" of ``kv_lora_rank +
qk_rope_head_dim`` (keys: the whole vector; values: its first ``kv_lora_rank`` values), and ``W_UV`` is
applied to the latent output. Only the latent is ever read: that is what makes long-context decode
cheap. Any attention backend serves it (the same cache tensor is passed as K and V; the output's RoPE
columns are dropped), and the tier path merges spilled segments exactly as for GQA.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.kernels import AttentionBackend, AttentionMetadata, attend_spilled, linear, rms_norm, rotate_heads, write_cache
from strata.pipeline.models.model_config import TextConfig
from strata.pipeline.models.quant_modules import QuantLinear

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm and kv_a_layernorm use the RMSNorm default


class _Norm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class MLAAttention(nn.Module):
    """Projections, the latent cache write and absorbed attention of one layer. Parameter names are the
    checkpoint's (``q_a_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ...)."""

    kv_scales: tuple[float, float] | None = None  # an FP8 cache's latent scale, twice (``kv_scales.py``)

    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.layer_idx = cfg.kv_index(layer_idx)  # its layer in the KV layout
        self.num_heads = cfg.num_heads
        self.nope, self.rope, self.rank, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
        self.scale = cfg.attention_scale
        self.interleave = cfg.rope_interleave
        self.positional = cfg.rope  # False (Kimi-Linear): the "RoPE" parts of q and k are used as they come
        h, q_dim = cfg.hidden_size, cfg.num_heads * m.qk_head_dim
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=False)
            self.q_a_layernorm = _Norm(m.q_lora_rank)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = _Norm(m.kv_lora_rank)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * m.v_head_dim, h, bias=False)
        # DeepSeek lays rope dims out in pairs (x0, x1), (x2, x3)...; its rotation writes [evens, odds]
        # rotated by the half-split rule, so gathering evens then odds first makes it ours, bit for bit.
        self._pairs = torch.cat([torch.arange(0, self.rope, 2, device="cpu"), torch.arange(1, self.rope, 2, device="cpu")]) if self.interleave else None

    def join_group(self, full: TextConfig, all_reduce: object, kv_replicas: int) -> None:
        """On a tensor-parallel rank: nothing to share (each rank computes the whole latent, its heads alone)."""

    def fuse(self) -> None:
        """Nothing to fuse. A ``kv_b_proj`` stored quantized is dequantized once here, as vLLM does: the
        absorbed form splits it per head into W_UK and W_UV (a few percent of the model's weights)."""
        if isinstance(self.kv_b_proj, QuantLinear):
            self.kv_b_proj = self.kv_b_proj.dense(self.kv_a_layernorm.weight.dtype)  # type: ignore[assignment]

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, rank], W_UV [H, v, rank]): views of ``kv_b_proj`` split per head."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        if not self.positional:
            return x
        if self._pairs is not None:
            x = x.index_select(-1, self._pairs.to(x.device))
        return rotate_heads(x, cos, sin_signed)

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, q_resid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the normed hidden state: (q_nope [T, H, nope], q_pe [T, H, rope] rotated, latent [T, 1, rank+rope]).
        ``q_resid``: the q LoRA's normed output when the caller computed it (DSA's indexer reads it too)."""
        t = h.shape[0]
        if hasattr(self, "q_a_proj"):
            if q_resid is None:
                q_resid = rms_norm(linear(h, self.q_a_proj.weight), self.q_a_layernorm.weight, LATENT_NORM_EPS)
            q = linear(q_resid, self.q_b_proj.weight)
        else:
            q = linear(h, self.q_proj.weight)
        q = q.view(t, self.num_heads, self.nope + self.rope)
        ckv = linear(h, self.kv_a_proj_with_mqa.weight)
        c = rms_norm(ckv[:, : self.rank], self.kv_a_layernorm.weight, LATENT_NORM_EPS)
        k_pe = self._rotate(ckv[:, None, self.rank :], cos, sin_signed)
        q_pe = self._rotate(q[..., self.nope :], cos, sin_signed)
        return q[..., : self.nope], q_pe, torch.cat([c[:, None], k_pe], dim=-1)

    def run(self, x: torch.Tensor, ln: nn.Module, cos: torch.Tensor, sin_signed: torch.Tensor, kv: list[torch.Tensor],
            meta: AttentionMetadata, backend: AttentionBackend, steps: object = None) -> torch.Tensor:
        """Input norm, projections, latent write, absorbed attention: [T, H, v_head_dim] before o_proj.
        (``steps``: the GQA component's compiled dense parts; MLA's dense parts run eagerly.)"""
        q_nope, q_pe, latent = self.project(rms_norm(x, ln.weight, ln.eps), cos, sin_signed)
        cache = kv[self.layer_idx][:, 0]  # [blocks, block_size, 1, rank + rope]
        s = self.kv_scales[0] if self.kv_scales is not None else None  # FP8: the latent stored over its scale
        write_cache(cache, latent if s is None else latent / s, meta.slot_mapping, meta.slot_blocks, meta.slot_offsets)
        w_uk, w_uv = self.absorbed()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)  # [T, H, rank]
        q = torch.cat([q_latent, q_pe], dim=-1).contiguous()
        if s is not None:
            q = q * s
        spilled = meta.spilled is not None
        out, lse = backend.forward(q, cache, cache, meta, self.scale, None, return_lse=spilled)
        if spilled:
            out = attend_spilled(q, out, lse, meta, self.layer_idx, self.scale, None)
        if s is not None:
            out = out * s
        o_latent = out[..., : self.rank]  # the RoPE columns of the "values" are not values: dropped
        return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2).to(o_latent.dtype)).transpose(0, 1).contiguous()

"""The decoder of every registered text family, assembled from components, over the paged KV cache.

A layer is input norm, an attention component (GQA with optional q/k norm, per head or over all heads,
here; MLA in
``models.attention_mla``), post-attention norm and a feed-forward component (dense SwiGLU, or a sparse
MoE from ``models.moe`` on the layers the config makes sparse); an :class:`MTPLayer` past them drafts
for speculative decoding (``models.mtp``). Tokens of all sequences in a step are
flattened to [T, hidden]; attention reads and writes the block pool through
:class:`kernels.AttentionMetadata`.

The modules keep the checkpoint's parameter names (``q_proj``, ``gate_proj``, ...) so weights load
by name; after loading, :meth:`LanguageModel.fuse_projections` concatenates q/k/v and gate/up into
one matrix each (the per-projection weights become views of it) so a layer runs two GEMMs fewer.
A layer step is: dense part before attention (norm, q/k/v, RoPE), paged attention (eager: it reads
the KV pool through the metadata), dense part after it (output projection, norm, MLP). The dense
parts are pure tensor functions in :class:`DenseSteps`, which ``pipeline.compiled`` can swap for
``torch.compile``d versions shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from strata.kernels import (
    AttentionBackend,
    AttentionMetadata,
    RotaryEmbedding,
    linear,
    rms_norm,
    rotate_heads,
    signed_sin,
)
from strata.kernels.layer_ops import silu_mul
from strata.kernels.norm import rms_norm_spanning
from strata.pipeline.models.attention_mla import MLAAttention
from strata.pipeline.models.attention_dsa import DSAAttention
from strata.pipeline.models.gated_deltanet import GatedDeltaNet
from strata.pipeline.models.kimi_delta import KimiDeltaAttention
from strata.pipeline.models.mlp import DenseMLP, fuse_rows
from strata.pipeline.models.model_config import TextConfig
from strata.pipeline.models.moe import SparseMoE, interleaved_experts_to_stacked
from strata.pipeline.models.paged_attend import paged_attend


def qkv_rope(x: torch.Tensor, ln_w: torch.Tensor, eps: float, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None,
             cos: torch.Tensor, sin_signed: torch.Tensor, hq: int, hkv: int, d: int):
    """Input norm, one q/k/v GEMM, RoPE on q and k heads in one pass: (q, k, v) as [T, heads, D]."""
    t = x.shape[0]
    qkv = linear(rms_norm(x, ln_w, eps), qkv_w, qkv_b).view(t, hq + 2 * hkv, d)
    qk = rotate_heads(qkv[:, : hq + hkv], cos, sin_signed)
    return qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]


def qkv_norm_rope(x: torch.Tensor, ln_w: torch.Tensor, eps: float, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None,
                  q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                  hq: int, hkv: int, d: int):
    """:func:`qkv_rope` with a per-head RMSNorm of q and k before RoPE (Qwen3)."""
    t = x.shape[0]
    qkv = linear(rms_norm(x, ln_w, eps), qkv_w, qkv_b).view(t, hq + 2 * hkv, d)
    qk = torch.cat([rms_norm(qkv[:, :hq], q_norm_w, eps), rms_norm(qkv[:, hq : hq + hkv], k_norm_w, eps)], dim=1)
    qk = rotate_heads(qk, cos, sin_signed)
    return qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]


def qkv_norm_over_heads_rope(x: torch.Tensor, ln_w: torch.Tensor, eps: float, qkv_w: torch.Tensor,
                             qkv_b: torch.Tensor | None, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor,
                             cos: torch.Tensor, sin_signed: torch.Tensor, hq: int, hkv: int, d: int,
                             spanning: "NormSpan | None" = None):
    """:func:`qkv_rope` with q and k each normalised over its whole projection, all heads at once
    (MiniMax-M2); ``spanning`` when this rank holds only some heads (the sums of squares are summed)."""
    t = x.shape[0]
    qkv = linear(rms_norm(x, ln_w, eps), qkv_w, qkv_b)
    q, k = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d]
    if spanning is None:
        q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
    else:
        q = rms_norm_spanning(q, q_norm_w, eps, spanning.q_width, spanning.sum_over_ranks)
        k = rms_norm_spanning(k, k_norm_w, eps, spanning.k_width, spanning.sum_over_ranks, spanning.kv_replicas)
    qk = rotate_heads(torch.cat([q, k], dim=1).view(t, hq + hkv, d), cos, sin_signed)
    return qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d :].view(t, hkv, d)


@dataclass(frozen=True)
class NormSpan:
    """A q/k norm over every head, computed on a rank that holds some (``ParallelLanguageModel`` sets it):
    the full widths, the group's sum, and how many ranks hold each KV head."""

    q_width: int
    k_width: int
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]
    kv_replicas: int = 1


def out_proj_norm(x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
                  ln_w: torch.Tensor, eps: float):
    """Residual after attention's output projection, and the post-attention norm of it."""
    x = x + linear(attn.reshape(x.shape[0], -1), o_w, o_b)
    return x, rms_norm(x, ln_w, eps)


def out_proj_mlp(x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None, ln_w: torch.Tensor,
                 eps: float, gate_up_w: torch.Tensor, gate_up_b: torch.Tensor | None, down_w: torch.Tensor,
                 down_b: torch.Tensor | None) -> torch.Tensor:
    """Everything after attention in a dense layer: output projection, residual, norm, SwiGLU MLP, residual."""
    x, h = out_proj_norm(x, attn, o_w, o_b, ln_w, eps)
    return x + linear(silu_mul(linear(h, gate_up_w, gate_up_b)), down_w, down_b)


class DenseSteps:
    """The dense parts of a layer step, shared by every layer (eager here; compiled by ``pipeline.compiled``)."""

    def __init__(self) -> None:
        self.qkv_rope = qkv_rope
        self.qkv_norm_rope = qkv_norm_rope
        self.out_proj_norm = out_proj_norm
        self.out_proj_mlp = out_proj_mlp


class RMSNorm(nn.Module):
    """``scale_fp32``: the loader rounds the weight to the model dtype and holds it in fp32, so ``rms_norm``
    scales in fp32 and casts once, as gpt-oss's reference does (Llama's casts, then scales). ``offset``: the
    checkpoint stores w and the norm scales by 1 + w (Qwen3-Next); the loader adds the one, in fp32."""

    def __init__(self, size: int, eps: float, scale_fp32: bool = False, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.widen_after_cast = scale_fp32 or offset
        self.weight_offset = 1.0 if offset else 0.0

    @classmethod
    def of(cls, cfg: TextConfig, size: int) -> "RMSNorm":
        """A norm of ``size`` values as the family's norms compute."""
        return cls(size, cfg.rms_norm_eps, cfg.norm_scale_fp32, cfg.norm_offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """GQA/MHA/MQA of one layer: one fused q/k/v GEMM with RoPE (and q/k norm), paged attention."""

    kv_scales: tuple[float, float] | None = None  # an FP8 cache's (key, value) scales (``kv_scales.py``)

    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = cfg.kv_index(layer_idx)  # its layer in the KV layout (linear layers cache none)
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.layer_windows[layer_idx] if layer_idx < cfg.num_layers else None  # MTP: full
        self.gated = cfg.attention_gate  # q_proj gives each head [query, gate] (Qwen3-Next)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim * (1 + self.gated),
                                bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # per head, or over the whole projection (MiniMax-M2)
            q_heads, k_heads = (cfg.num_heads, cfg.num_kv_heads) if cfg.qk_norm_over_heads else (1, 1)
            self.q_norm = RMSNorm(cfg.head_dim * q_heads, cfg.rms_norm_eps, offset=cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim * k_heads, cfg.rms_norm_eps, offset=cfg.norm_offset)
        self.norm_over_heads = cfg.qk_norm_over_heads
        self.norm_span: NormSpan | None = None  # set on a tensor-parallel rank
        # gpt-oss: a learned logit per head in every softmax (``kernels.sinks``)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.sinks else None
        self.qkv_weight: torch.Tensor | None = None  # set by fuse
        self.qkv_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        self.qkv_weight, self.qkv_bias = fuse_rows(self.q_proj, self.k_proj, self.v_proj)

    def join_group(self, full: TextConfig, all_reduce: Callable[[torch.Tensor], torch.Tensor], kv_replicas: int) -> None:
        """On a tensor-parallel rank (``full``: the whole model's config): a q/k norm over every head sums its
        squares over the group, since other ranks hold the other heads (MiniMax-M2)."""
        if self.norm_over_heads:
            self.norm_span = NormSpan(full.num_heads * full.head_dim, full.num_kv_heads * full.head_dim, all_reduce,
                                      kv_replicas)

    def run(self, x: torch.Tensor, ln: RMSNorm, cos: torch.Tensor, sin_signed: torch.Tensor, kv: list[torch.Tensor],
            meta: AttentionMetadata, backend: AttentionBackend, steps: DenseSteps) -> torch.Tensor:
        """Input norm, q/k/v with RoPE, paged attention: [T, heads, D], before the output projection."""
        if self.qkv_weight is None:
            self.fuse()
        if self.gated:
            return self._gated(x, ln, cos, sin_signed, kv, meta, backend)
        if self.norm_over_heads:  # eager: under tp its norm sums over the group
            q, k, v = qkv_norm_over_heads_rope(x, ln.weight, ln.eps, self.qkv_weight, self.qkv_bias, self.q_norm.weight,
                                               self.k_norm.weight, cos, sin_signed, self.num_heads, self.num_kv_heads,
                                               self.head_dim, self.norm_span)
        elif hasattr(self, "q_norm"):
            q, k, v = steps.qkv_norm_rope(x, ln.weight, ln.eps, self.qkv_weight, self.qkv_bias, self.q_norm.weight,
                                          self.k_norm.weight, cos, sin_signed, self.num_heads, self.num_kv_heads,
                                          self.head_dim)
        else:
            q, k, v = steps.qkv_rope(x, ln.weight, ln.eps, self.qkv_weight, self.qkv_bias, cos, sin_signed,
                                     self.num_heads, self.num_kv_heads, self.head_dim)
        return self.attend(q, k, v, kv, meta, backend)

    def _gated(self, x: torch.Tensor, ln: RMSNorm, cos: torch.Tensor, sin_signed: torch.Tensor,
               kv: list[torch.Tensor], meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """Qwen3-Next's attention: q and a per-head gate from one projection, q/k norm, RoPE, paged attention,
        the output scaled by the gate's sigmoid."""
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(rms_norm(x, ln.weight, ln.eps), self.qkv_weight, self.qkv_bias)
        q, gate = qkv[:, : 2 * hq * d].view(t, hq, 2 * d).split([d, d], dim=-1)
        k = qkv[:, 2 * hq * d : (2 * hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (2 * hq + hkv) * d :].view(t, hkv, d)
        qk = torch.cat([rms_norm(q, self.q_norm.weight, self.q_norm.eps), rms_norm(k, self.k_norm.weight, self.k_norm.eps)],
                       dim=1)
        qk = rotate_heads(qk, cos, sin_signed)
        out = self.attend(qk[:, :hq], qk[:, hq:], v.contiguous(), kv, meta, backend)
        return out * torch.sigmoid(gate)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: list[torch.Tensor], meta: AttentionMetadata,
               backend: AttentionBackend) -> torch.Tensor:
        """Write this step's k/v into the pool, attend over it (and over spilled blocks): [T, Hq, D]."""
        return paged_attend(q, k, v, kv, self.layer_idx, meta, backend, self.scale, self.sliding_window, self.sinks,
                            self.kv_scales)


# the module that computes each attention kind (``attention_kinds.AttentionKind.module``)
ATTENTION_MODULES: dict[str, type[Attention] | type[MLAAttention]] = {"gqa": Attention, "mla": MLAAttention,
                                                                      "mla_dsa": DSAAttention}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm.of(cfg, cfg.hidden_size)
        if cfg.is_linear_layer(layer_idx) and cfg.linear.kda:  # KDA: per-sequence state, stored as self_attn
            self.self_attn = KimiDeltaAttention(cfg, layer_idx)
        elif cfg.is_linear_layer(layer_idx):  # a Gated DeltaNet layer: per-sequence state, no KV
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn: Attention | MLAAttention = ATTENTION_MODULES[cfg.attention.module](cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm.of(cfg, cfg.hidden_size)
        if cfg.is_moe_layer(layer_idx):
            self.mlp: nn.Module = SparseMoE(cfg)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    @property
    def mixer(self) -> "Attention | MLAAttention | GatedDeltaNet | KimiDeltaAttention":
        """What mixes tokens in this layer: its attention, or its linear attention."""
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def attention(self, x, cos, sin_signed, kv, meta, backend, steps: DenseSteps) -> torch.Tensor:
        """Input norm and this layer's attention component: [T, heads, D], before the output projection."""
        return self.mixer.run(x, self.input_layernorm, cos, sin_signed, kv, meta, backend, steps)

    def forward(self, x, cos, sin_signed, kv, meta, backend, steps: DenseSteps) -> torch.Tensor:
        ln2, mlp = self.post_attention_layernorm, self.mlp
        attn = self.attention(x, cos, sin_signed, kv, meta, backend, steps)
        o = self.mixer.o_proj
        if isinstance(mlp, DenseMLP):
            if mlp.gate_up_weight is None:
                mlp.fuse()
            return steps.out_proj_mlp(x, attn, o.weight, o.bias, ln2.weight, ln2.eps, mlp.gate_up_weight,
                                      mlp.gate_up_bias, mlp.down_proj.weight, mlp.down_proj.bias)
        x, h = steps.out_proj_norm(x, attn, o.weight, o.bias, ln2.weight, ln2.eps)
        return x + mlp.forward(h)  # MoE: data-dependent routing stays eager


class SharedHead(nn.Module):
    """The MTP layer's final norm (its projection to the vocabulary is the model's ``lm_head``)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.norm = RMSNorm.of(cfg, cfg.hidden_size)


class MTPLayer(DecoderLayer):
    """One multi-token-prediction layer (``models.mtp``): a decoder layer of the family behind the join of
    (embedding, hidden)."""

    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        h = cfg.hidden_size
        self.enorm = RMSNorm.of(cfg, h)
        self.hnorm = RMSNorm.of(cfg, h)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(cfg)

    def draft(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin_signed: torch.Tensor, kv, meta, backend, steps) -> torch.Tensor:
        """Rows [T, hidden] of (token i+1's embedding, the model's h_i) at positions i: writes this layer's KV
        at those positions and returns its normed output, whose logits predict token i+2."""
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        joined = torch.cat([rms_norm(embeds, self.enorm.weight, self.enorm.eps),
                            rms_norm(hidden.to(embeds.dtype), self.hnorm.weight, self.hnorm.eps)], dim=-1)
        x = self.forward(linear(joined, self.eh_proj.weight), cos, sin_signed, kv, meta, backend, steps)
        return rms_norm(x, self.shared_head.norm.weight, self.shared_head.norm.eps)


class LanguageModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head."""

    layer_class: type[DecoderLayer] = DecoderLayer  # the tensor-parallel model swaps in its own
    compute_dtype: torch.dtype = torch.float32  # set by the loader (norms may be held in fp32, embeddings quantized)

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        if cfg.mtp_layers:  # the drafter's layer past the decoder, loaded under its checkpoint index
            self.layers.extend(MTPLayer(cfg, cfg.num_layers + j) for j in range(cfg.mtp_layers))
        self.norm = RMSNorm.of(cfg, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.rope_dim, cfg.rope_parameters, cfg.mrope_section, cfg.mrope_interleaved)
        self.steps = DenseSteps()

    def fuse_projections(self) -> None:
        """After loading: one q/k/v matrix and one gate/up matrix per layer (weights become views)."""
        for layer in self.layers:
            layer.mixer.fuse()
            if isinstance(layer.mlp, SparseMoE) and layer.mlp.shared_experts is not None:
                layer.mlp.shared_experts.fuse()
            if isinstance(layer.mlp, DenseMLP):
                layer.mlp.fuse()

    def split_fused(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """The loader's hook for a checkpoint tensor in another layout than ours: gpt-oss's experts."""
        moe = self.cfg.moe
        if moe is None or not moe.expert_kind.interleaved_gate_up:
            return None
        stacked = interleaved_experts_to_stacked(name, tensor)
        return None if stacked is None else [(name, stacked)]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids)

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        kv: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run all layers over flattened token embeddings [T, hidden] at ``positions`` ([T], or [3, T] under
        M-RoPE); returns final-normed hidden [T, hidden]. ``deepstack`` (Qwen3-VL): image rows [R] and
        their features [levels, R, hidden]; level k is added to layer k's output at those rows."""
        cos, sin = self.rope.cos_sin(positions, embeds.dtype)
        sin_signed = signed_sin(sin)
        x = embeds
        levels = 0 if deepstack is None else deepstack[1].shape[0]
        for i in range(self.cfg.num_layers):  # an MTP layer past them drafts (``draft``)
            x = self.layers[i].forward(x, cos, sin_signed, kv, meta, backend, self.steps)
            if i < levels:
                rows, feats = deepstack  # type: ignore[misc]
                x = x.index_add(0, rows, feats[i].to(x.dtype))
        return rms_norm(x, self.norm.weight, self.norm.eps)

    def draft(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv: list[torch.Tensor],
              meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """The MTP layer (``models.mtp``) over rows (token i+1, final hidden h_i) at positions i: its normed
        output [T, hidden], whose ``logits`` predict token i+2."""
        cos, sin = self.rope.cos_sin(positions, hidden.dtype)
        mtp = self.layers[self.cfg.num_layers]
        return mtp.draft(self.embed(token_ids), hidden, positions, cos, signed_sin(sin), kv, meta, backend, self.steps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head.weight).float()

"""The DeepSeek-V4 decoder: mHC streams around compressed attention and a sqrt-softplus MoE, over the paged cache.

A layer collapses the token's ``hc_mult`` residual streams into the attention's input (``hyper_connections``),
runs :class:`attention_v4.V4Attention` over its paged caches (``v4_paged_step``: projections and writes over
the whole step, a decode step's sequences attended together), spreads the output back over the streams, and
does the same around the MoE. The MoE's first layers route by token id (``tid2eid``), so the step's token ids
ride on the attention metadata. Norms keep fp32 weights, as the reference keeps them. Multi-token-prediction
layers are not loaded (``strata ops`` says so).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import AttentionBackend, AttentionMetadata, linear, moe_experts
from strata.kernels.compress_kv import rms_norm_fp32_weight
from strata.kernels.rope import RotaryEmbedding
from strata.pipeline.models import router_kinds
from strata.pipeline.models.attention_v4 import V4Attention, V4Geometry, V4Span
from strata.pipeline.models.decoder import LanguageModel
from strata.pipeline.models.hyper_connections import HyperConnection, HyperHead, expand
from strata.pipeline.models.moe import Router, SparseMoE
from strata.pipeline.models.text_config import TextConfig
from strata.pipeline.models.v4_paged_cache import V4CacheFormat
from strata.pipeline.models.v4_paged_step import PagedV4Step


class FP32Norm(nn.Module):
    """RMSNorm whose weight stays in fp32 (``DeepseekV4RMSNorm``)."""

    keep_fp32 = True

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32_weight(x, self.weight, self.eps)


class ClampedSharedExpert(nn.Module):
    """V4's shared expert: SwiGLU with the gate clamped from above and the up from both sides."""

    def __init__(self, hidden: int, intermediate: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = linear(x, self.gate_proj.weight).clamp(max=self.limit)
        up = linear(x, self.up_proj.weight).clamp(min=-self.limit, max=self.limit)
        return linear(F.silu(gate) * up, self.down_proj.weight)


class V4MoE(SparseMoE):
    """Routed experts by sqrt-softplus scores (fixed per token id on a hash layer) plus the clamped shared expert."""

    def __init__(self, cfg: TextConfig, hashed: bool) -> None:
        super().__init__(cfg)
        moe = cfg.moe
        assert moe is not None
        if hashed:
            self.gate = Router(moe, cfg.hidden_size, router_kinds.HASH_SQRTSOFTPLUS, cfg.vocab_size)
        self.shared_experts = ClampedSharedExpert(cfg.hidden_size, moe.shared_intermediate_size, moe.swiglu_limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor,  # type: ignore[override]
                first_expert: int = 0) -> torch.Tensor:
        """Routed experts (chosen by score, or by ``token_ids`` [T] on a hash layer; only ``first_expert ..`` of
        them when this rank holds a run) plus the shared expert (this rank's columns of it)."""
        weights, ids = self.gate.route(x, token_ids)
        e = self.experts
        return moe_experts(x, e.gate_up_proj, e.down_proj, weights, ids, first_expert, None, None, self.act) + \
            self.shared_experts(x)


class V4DecoderLayer(nn.Module):
    """Compressed attention and the MoE, each between a collapse and an expansion of the mHC streams."""

    first_expert = 0  # the first routed expert this process holds (``deepseek_v4_parallel``)
    layout_scales: tuple[float, ...] | None = None  # an FP8 cache's scale per KV-layout layer (``kv_scales``)

    def __init__(self, cfg: TextConfig, layer_idx: int, main_rope: RotaryEmbedding,
                 compress_rope: RotaryEmbedding) -> None:
        super().__init__()
        c = cfg.compressed
        assert c is not None
        self.layer_idx, self.c = layer_idx, c
        sparse = c.sparse[layer_idx]
        g = V4Geometry(cfg.hidden_size, cfg.num_heads, c.head_dim, c.rope_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank,
                       c.window, c.compress[layer_idx], c.index_heads if sparse else 0, c.index_dim,
                       c.index_topk if sparse else 0, cfg.rms_norm_eps)
        self.self_attn = V4Attention(g, (main_rope.inv_freq, main_rope.attention_scaling),
                                     (compress_rope.inv_freq, compress_rope.attention_scaling))
        self.mlp = V4MoE(cfg, c.hash_layers[layer_idx])
        self.input_layernorm = FP32Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = FP32Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(c.hc_mult, cfg.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, cfg.rms_norm_eps)
        self.ffn_hc = HyperConnection(c.hc_mult, cfg.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, cfg.rms_norm_eps)

    def forward(self, streams: torch.Tensor, kv: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        post, comb, collapsed = self.attn_hc(streams)
        h = self.input_layernorm(collapsed)
        spans = [V4Span(seq_len - rows, rows, meta.prompt_len(i))
                 for i, (rows, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_list))]
        fmt = V4CacheFormat(streams.dtype, self.layout_scales)
        attended = self.self_attn(h, spans, PagedV4Step(kv, meta, self.layer_idx, self.c, fmt))
        streams = expand(streams, self.sum_partial(attended), post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        assert meta.token_ids is not None, "DeepSeek-V4's hash layers route by the step's token ids"
        out = self.mlp(self.post_attention_layernorm(collapsed), meta.token_ids, self.first_expert)
        return expand(streams, self.sum_partial(out), post, comb)

    def sum_partial(self, partial: torch.Tensor) -> torch.Tensor:
        """A block's output as this process computed it: whole here (a tensor-parallel rank sums its group's)."""
        return partial


class V4LanguageModel(LanguageModel):
    """Embeddings spread over ``hc_mult`` streams, the V4 layers, the head that collapses the streams, the norm."""

    v4_layer_class: type[V4DecoderLayer] = V4DecoderLayer  # the tensor-parallel model swaps in its own

    def __init__(self, cfg: TextConfig) -> None:
        nn.Module.__init__(self)
        c = cfg.compressed
        assert c is not None
        self.cfg = cfg
        main = RotaryEmbedding(c.head_dim, cfg.rope_parameters)
        compress = RotaryEmbedding(c.head_dim, c.compress_rope)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.v4_layer_class(cfg, i, main, compress) for i in range(cfg.num_layers))
        self.hc_head = HyperHead(c.hc_mult, cfg.hidden_size, c.hc_eps, cfg.rms_norm_eps)
        self.norm = FP32Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def fuse_projections(self) -> None:
        """Nothing to fuse: each projection feeds its own path."""

    def set_layout_kv_scales(self, scales: list[tuple[float, float]] | None) -> None:
        """An FP8 cache's scales (``models.kv_scales``): a layer reads and writes several KV-layout layers (its
        window, projections, entries, indexer keys), each over its own scale (one part each: the key's)."""
        for layer in self.layers:
            layer.layout_scales = None if scales is None else tuple(k for k, _ in scales)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, kv: list[torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend, deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Final-normed hidden [T, hidden] of the step's rows (positions come from the metadata)."""
        streams = embeds.unsqueeze(1).expand(-1, self.cfg.compressed.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, kv, meta)
        return self.norm(self.hc_head(streams))

"""The decoder's part of a checkpoint's config: :class:`TextConfig` (with ``attention_kinds.MLAConfig`` and
:class:`MoEConfig` when the family uses them) and how a family's config fields map onto it
(``parse_text_config``). Which fields mean what is the registry's business (``models.architectures``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from strata.pipeline.models.architectures import TEXT_FAMILIES, TextFamily
from strata.pipeline.models.attention_kinds import (GQA, LINEAR_KINDS, AttentionKind, DSAConfig, GatedDeltaNetConfig,
                                                   MLAConfig)
from strata.pipeline.models.compressed_attention_config import CompressedAttentionConfig, resolve_compressed_attention
from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.config_values import MAX_LAYERS, checked_size, divides, size
from strata.pipeline.models.expert_kinds import SWIGLU, ExpertKind
from strata.pipeline.models.router_kinds import SOFTMAX_MIXTRAL, RouterKind

TEXT_MODEL_TYPES = tuple(TEXT_FAMILIES)


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of the sparse layers and how tokens are routed to them."""

    num_experts: int
    experts_per_tok: int
    intermediate_size: int  # of one routed expert
    router: RouterKind = SOFTMAX_MIXTRAL  # how tokens choose experts (``router_kinds``)
    norm_topk_prob: bool = True  # the router renormalises the chosen weights (the kind's rule, resolved)
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 0
    shared_width: int = 0  # the shared experts' total width when the config says it (Qwen3-Next), else per expert
    shared_gate: bool = False  # the shared experts' output is scaled by sigmoid(a linear of the input) (Qwen3-Next)
    shared_split: int = 1  # ranks the shared experts' columns are split over (tensor parallelism)
    expert_kind: ExpertKind = SWIGLU  # what an expert computes and how it is stored (``expert_kinds``)
    swiglu_alpha: float = 1.702  # the clamped kind's constants
    swiglu_limit: float = 7.0

    @property
    def expert_bias(self) -> bool:
        return self.expert_kind.bias

    @property
    def shared_intermediate_size(self) -> int:
        """Columns of the shared experts (fused as one MLP) this process holds."""
        return self.shared_total // self.shared_split

    @property
    def shared_total(self) -> int:
        """Columns of the shared experts, all ranks together."""
        return self.shared_width or self.intermediate_size * self.n_shared_experts


@dataclass(frozen=True)
class TextConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    max_position_embeddings: int
    attention_bias: bool  # q/k/v bias (Qwen2, Llama with attention_bias)
    o_bias: bool
    mlp_bias: bool
    layer_windows: tuple[int | None, ...]  # sliding window per layer (None = full attention)
    tie_word_embeddings: bool
    num_experts: int = 0  # > 0: sparse MoE layers (``moe`` says how they route)
    experts_per_tok: int = 0
    hidden_act: str = "silu"
    attention: AttentionKind = GQA  # the kind that resolved the attention fields below (``attention_kinds``)
    qk_norm: bool = False
    qk_norm_over_heads: bool = False  # the q/k norm spans all heads' projection at once (MiniMax-M2)
    sinks: bool = False  # a learned logit per head in every softmax (gpt-oss; ``kernels.sinks``)
    norm_scale_fp32: bool = False  # RMSNorm weights held in fp32: scale before the cast (gpt-oss; ``kernels.norm``)
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    moe_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or the dense MLP; () = every layer dense
    rope_interleave: bool = False  # RoPE pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of the two halves
    mrope_section: tuple[int, ...] = ()  # M-RoPE (Qwen-VL): frequencies per position axis (t, h, w); () = 1-D RoPE
    mrope_interleaved: bool = False  # Qwen3-VL: the axes take turns frequency by frequency
    # multi-token prediction (DeepSeek-V3, GLM-4.5): layers past ``num_layers`` in the checkpoint, whether each
    # routes to experts by the family's rule, and how many of them this load runs as a speculative drafter
    nextn_layers: int = 0
    nextn_moe: tuple[bool, ...] = ()
    mtp_layers: int = 0
    # linear attention (Qwen3-Next, Kimi-Linear): which layers are Gated DeltaNet or KDA, and its geometry; their
    # state is per sequence (``kvstore.state_pool``), so only the other layers cache KV
    linear: GatedDeltaNetConfig | None = None
    linear_layers: tuple[bool, ...] = ()
    norm_offset: bool = False  # RMSNorm weights are stored as w, scale by 1 + w (Qwen3-Next)
    attention_gate: bool = False  # a sigmoid gate per head on the attention output (Qwen3-Next)
    rope: bool = True  # False: attention takes no positions (Kimi-Linear's MLA, NoPE)
    dsa: DSAConfig | None = None  # sparse MLA over an indexer's top-k (DeepSeek-V3.2): an indexer key cached per token
    # DeepSeek-V4: a sliding window plus pooled entries per layer, mHC streams, hash-routed first layers
    compressed: CompressedAttentionConfig | None = None

    @property
    def uses_mrope(self) -> bool:
        """Positions are 3-D (temporal, height, width): image tokens get their place in the image."""
        return bool(self.mrope_section)

    def is_moe_layer(self, layer: int) -> bool:
        """Routed experts at ``layer``; past the decoder, an MTP layer follows the family's rule too."""
        if layer >= self.num_layers:
            return bool(self.nextn_moe) and self.nextn_moe[layer - self.num_layers]
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def cached_layers(self) -> int:
        """Layers that keep per-token KV: the decoder's (not its linear-attention ones), and the MTP layers
        this load drafts with."""
        return self.num_layers - sum(self.linear_layers) + self.mtp_layers

    @property
    def index_layers(self) -> int:
        """Layers that run a DSA indexer and cache its key per token (every attention layer of DeepSeek-V3.2;
        GLM-5's not sharing another's choice), KV-layout layers after the attention layers' (``cache_groups``)."""
        if self.dsa is None:
            return 0
        return sum(self.dsa.runs_indexer(i) for i in range(self.num_layers) if not self.is_linear_layer(i))

    def index_kv_index(self, layer: int) -> int:
        """The KV-layout layer holding model layer ``layer``'s indexer keys (a layer that runs its indexer)."""
        assert self.dsa is not None and self.dsa.runs_indexer(layer)
        return self.cached_layers + sum(self.dsa.runs_indexer(i) for i in range(layer) if not self.is_linear_layer(i))

    def is_linear_layer(self, layer: int) -> bool:
        return layer < self.num_layers and bool(self.linear_layers) and self.linear_layers[layer]

    def kv_index(self, layer: int) -> int:
        """Where model layer ``layer`` (an attention layer, or an MTP layer past the decoder) sits among the
        layers that cache KV: the KV layout's layer index, which its attention reads and writes."""
        return layer - sum(self.linear_layers[:layer])

    def linear_index(self, layer: int) -> int:
        """Where linear-attention layer ``layer`` sits among them: its row of the state pool."""
        return sum(self.linear_layers[:layer])

    @property
    def kv_layer_windows(self) -> tuple[int | None, ...]:
        """The sliding window of each layer that caches KV, in KV-layout order."""
        return tuple(w for i, w in enumerate(self.layer_windows) if not self.is_linear_layer(i))

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates per head (MLA: only the decoupled rope part)."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_parts(self) -> int:
        """Tensors cached per token per layer: K and V (2), or MLA's one latent (1)."""
        return 1 if self.mla else 2

    @property
    def kv_cache_heads(self) -> int:
        return 1 if self.mla else self.num_kv_heads

    @property
    def kv_cache_dim(self) -> int:
        return self.mla.latent_dim if self.mla else self.head_dim

    @property
    def attention_scale(self) -> float:
        """Softmax scale: 1/sqrt(q.k dims), times yarn's mscale squared when the config asks for it."""
        dim = self.mla.qk_head_dim if self.mla else self.head_dim
        scale = dim ** -0.5
        p = self.rope_parameters
        if self.mla and p.get("rope_type", "default") != "default" and p.get("mscale_all_dim"):
            m = _yarn_mscale(float(p["factor"]), float(p["mscale_all_dim"]))
            scale *= m * m
        return scale


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature, the same formula as ``kernels.rope`` (this module stays torch-free)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_parameters(tc: dict[str, Any], head_dim: int) -> dict[str, Any]:
    params = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
    params.setdefault("rope_theta", tc.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    if params["rope_type"] == "mrope":  # Qwen2-VL's releases name M-RoPE as a type; its frequencies are default
        params["rope_type"] = "default"
    if params["rope_type"] == "yarn":
        params.setdefault("original_max_position_embeddings", tc.get("max_position_embeddings"))
    if "partial_rotary_factor" in tc and "partial_rotary_factor" not in params:  # transformers 4's top-level key
        params["partial_rotary_factor"] = tc["partial_rotary_factor"]
    if tc.get("rotary_dim") and "partial_rotary_factor" not in params:  # MiniMax's releases count the dims
        params["partial_rotary_factor"] = checked_size(tc["rotary_dim"], "rotary_dim") / head_dim
    return params


def _moe(tc: dict[str, Any], family: TextFamily, layers: int) -> tuple[MoEConfig | None, tuple[bool, ...]]:
    """The experts, and which of ``layers`` (the decoder's and its MTP layers) route to them."""
    key = next((k for k in family.experts_keys if tc.get(k)), None)
    if family.router is None or key is None:
        return None, ()
    experts = checked_size(tc[key], key)
    per_token = size(tc, "num_experts_per_tok")
    if per_token > experts:
        raise ModelConfigError(f"config.json: num_experts_per_tok ({per_token}) exceeds {key} ({experts})")
    routing = family.router.routing(tc, experts)
    shared_width = int(tc.get(family.shared_expert_key) or 0) if family.shared_expert_key else 0
    moe = MoEConfig(
        num_experts=experts,
        experts_per_tok=per_token,
        intermediate_size=size(tc, family.expert_size_key),
        router=family.router,
        norm_topk_prob=routing.renormalize,
        routed_scaling_factor=routing.scaling,
        n_group=routing.n_group,
        topk_group=routing.topk_group,
        n_shared_experts=int(tc.get("n_shared_experts") or 0) if family.shared_experts else int(shared_width > 0),
        shared_width=shared_width,
        shared_gate=shared_width > 0,
        expert_kind=family.experts,
        **family.experts.settings(tc),
    )
    return moe, family.sparse_layers(tc, layers)


def parse_text_config(tc: dict[str, Any], family_name: str | None = None) -> TextConfig:
    model_type = family_name or tc.get("model_type", "llama")
    family = TEXT_FAMILIES.get(model_type)
    if family is None:
        raise ModelConfigError(f"unsupported text model_type {model_type!r}; supported: {', '.join(TEXT_MODEL_TYPES)}")
    tc = family.config_view(tc)
    heads = size(tc, "num_attention_heads")
    hidden = size(tc, "hidden_size")
    if tc.get("head_dim"):
        head_dim = checked_size(tc["head_dim"], "head_dim")
    else:
        divides(heads, "num_attention_heads", hidden, "hidden_size")
        head_dim = hidden // heads
    layers = size(tc, "num_hidden_layers", maximum=MAX_LAYERS)
    kv_heads = size(tc, "num_key_value_heads", None) if tc.get("num_key_value_heads") is not None else heads
    divides(kv_heads, "num_key_value_heads", heads, "num_attention_heads")
    act = tc.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"unsupported text hidden_act {act!r} (only silu)")
    attention = family.attention.resolve(tc)
    mla = attention.mla
    nextn = tc.get("num_nextn_predict_layers") or 0
    if not isinstance(nextn, int) or isinstance(nextn, bool) or not 0 <= nextn <= 8:
        raise ModelConfigError(f"config.json: num_nextn_predict_layers must be 0..8, got {nextn}")
    moe, sparse = _moe(tc, family, layers + nextn)
    moe_layers, nextn_moe = sparse[:layers], sparse[layers:]
    linear_layers = family.linear_layers(tc, layers) if family.linear_layers is not None else ()
    linear = LINEAR_KINDS[family.linear_kind](tc, family.linear_split_projections) if any(linear_layers) else None
    if linear_layers and all(linear_layers):
        raise ModelConfigError("config.json: every layer is linear attention; a hybrid needs full-attention layers")
    compressed = resolve_compressed_attention(tc, layers) if family.attention.compressed else None
    rope_parameters = _rope_parameters(tc, mla.qk_rope_head_dim if mla else int(head_dim))
    if compressed is not None:  # V4's sliding-only layers rotate by "main"; compressed ones by ``compress_rope``
        main = (tc.get("rope_parameters") or {}).get("main")
        rope_parameters = dict(main) if isinstance(main, dict) else {
            "rope_type": "default", "rope_theta": float(tc.get("rope_theta", 10000.0))}
        rope_parameters["partial_rotary_factor"] = compressed.rope_dim / compressed.head_dim
    factor = float(rope_parameters.get("partial_rotary_factor", 1.0))
    rotated = int((mla.qk_rope_head_dim if mla else head_dim) * factor)
    if not 0 < rotated <= (mla.qk_rope_head_dim if mla else head_dim) or rotated % 2:
        raise ModelConfigError(f"config.json: partial_rotary_factor {factor} rotates {rotated} dims of a head: "
                               "need an even count > 0")
    positions = family.positions.resolve(tc, rotated)  # M-RoPE's sections share out the rotated dims
    if positions.get("rope") is False and mla is None:
        raise ModelConfigError(f"{model_type}: attention without positions is implemented for MLA only")
    return TextConfig(
        model_type=model_type,
        vocab_size=size(tc, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=size(tc, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads if mla else (1 if compressed else kv_heads),
        head_dim=mla.v_head_dim if mla else int(head_dim),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        rope_parameters=rope_parameters,
        max_position_embeddings=size(tc, "max_position_embeddings", 4096),
        attention_bias=attention.attention_bias,
        o_bias=attention.o_bias,
        mlp_bias=bool(tc.get("mlp_bias", False)),
        layer_windows=family.windows(tc, layers),
        tie_word_embeddings=bool(tc.get("tie_word_embeddings", False)),
        num_experts=moe.num_experts if moe else 0,
        experts_per_tok=moe.experts_per_tok if moe else 0,
        hidden_act=act,
        attention=family.attention,
        qk_norm=attention.qk_norm,
        qk_norm_over_heads=attention.qk_norm_over_heads,
        sinks=attention.sinks,
        norm_scale_fp32=family.norm_scale_fp32,
        mla=mla,
        moe=moe,
        moe_layers=moe_layers,
        nextn_layers=nextn,
        nextn_moe=nextn_moe,
        linear=linear,
        linear_layers=linear_layers if linear is not None else (),
        norm_offset=family.norm_offset,
        attention_gate=attention.output_gate,
        rope_interleave=(family.rope_interleave if family.rope_interleave is not None
                         else bool(tc.get("rope_interleave", False))) if mla else False,
        dsa=attention.dsa,
        compressed=compressed,
        **positions,
    )

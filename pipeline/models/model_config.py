"""Typed view of a checkpoint's ``config.json``: what our model code needs, nothing more.

Which fields mean what is the registry's business (``models.architectures``); this module turns a
config into frozen dataclasses the components are built from: :class:`TextConfig` for the decoder
(with :class:`MLAConfig` and :class:`MoEConfig` when the family uses them), :class:`VisionConfig` for a
CLIP tower, and :class:`ModelConfig` around them (``vision`` is None for a text-only LLM).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from strata.pipeline.models.architectures import (
    TEXT_FAMILIES,
    ModelArchitecture,
    TextFamily,
    UnknownArchitecture,
    resolve_architecture,
)

TEXT_MODEL_TYPES = tuple(TEXT_FAMILIES)


class ModelConfigError(ValueError):
    """The checkpoint's config cannot be served; the message says why."""


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): K and V live as one compressed latent."""

    q_lora_rank: int | None  # None: q is one projection of the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the compressed KV and the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of the sparse layers and how tokens are routed to them."""

    num_experts: int
    experts_per_tok: int
    intermediate_size: int  # of one routed expert
    router: str = "softmax"  # "softmax" | "sigmoid-grouped"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 0
    shared_split: int = 1  # ranks the shared experts' columns are split over (tensor parallelism)

    @property
    def shared_intermediate_size(self) -> int:
        """Columns of the shared experts (fused as one MLP) this process holds."""
        return self.intermediate_size * self.n_shared_experts // self.shared_split


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
    qk_norm: bool = False
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    moe_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or the dense MLP; () = every layer dense
    rope_interleave: bool = False  # RoPE pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of the two halves
    mrope_section: tuple[int, ...] = ()  # M-RoPE (Qwen-VL): frequencies per position axis (t, h, w); () = 1-D RoPE
    mrope_interleaved: bool = False  # Qwen3-VL: the axes take turns frequency by frequency

    @property
    def uses_mrope(self) -> bool:
        """Positions are 3-D (temporal, height, width): image tokens get their place in the image."""
        return bool(self.mrope_section)

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

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


@dataclass(frozen=True)
class VisionConfig:
    """A CLIP ViT (a class token, a pre-norm) or a SigLIP ViT (neither; its patch embedding has a bias)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    kind: str = "clip"  # "clip" | "siglip"
    pooling_head: bool = False  # SigLIP's attention-pooling head is stored (never run: LLaVA reads a hidden state)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def class_token(self) -> bool:
        return self.kind == "clip"


@dataclass(frozen=True)
class MoonViTConfig:
    """Kimi-K2.5's native-resolution tower: patches of any image, a learned position grid resampled
    to each image, 2-D axial RoPE, and a 2x2 merge into one token per four patches."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    pos_emb_height: int
    pos_emb_width: int
    merge_kernel: tuple[int, int]
    hidden_act: str
    rope_theta: float
    projection_eps: float

    @property
    def merge_group(self) -> int:
        return self.merge_kernel[0] * self.merge_kernel[1]


@dataclass(frozen=True)
class QwenVisionConfig:
    """The Qwen-VL native-resolution ViTs: patches of two frames (a still image is repeated), 2-D RoPE,
    and a merger that turns each 2x2 group of patches into one language-model token. Qwen2.5-VL
    ("qwen2.5"): 14 px patches, window attention but in ``fullatt_block_indexes``, RMSNorm and SwiGLU
    blocks. Qwen3-VL ("qwen3"): 16 px patches, a learned position grid resampled to each image, full
    attention, LayerNorm and GELU blocks, and DeepStack: the features of ``deepstack_visual_indexes``
    blocks, each through its own merger, are added to the first decoder layers' outputs."""

    variant: str  # "qwen2.5" | "qwen3"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    spatial_merge_size: int
    window_size: int  # pixels on a side of an attention window
    fullatt_block_indexes: tuple[int, ...]
    out_hidden_size: int
    hidden_act: str
    rope_theta: float
    num_position_embeddings: int = 0  # Qwen3-VL: a square learned grid of this many positions
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks whose features feed DeepStack

    @property
    def merge_group(self) -> int:
        return self.spatial_merge_size**2

    @property
    def deepstack_levels(self) -> int:
        return len(self.deepstack_visual_indexes)

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch as the processor writes it: channels x frames x p x p."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def parse_qwen_vision_config(vc: dict[str, Any], variant: str) -> QwenVisionConfig:
    rope = vc.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ModelConfigError(f"vision rope_type {rope.get('rope_type')!r} is not supported (only axial)")
    qwen3 = variant == "qwen3"
    act = vc.get("hidden_act", "gelu_pytorch_tanh" if qwen3 else "silu")
    if not qwen3 and act != "silu":
        raise ModelConfigError(f"unsupported vision hidden_act {act!r} (Qwen2.5-VL's tower is SwiGLU: silu)")
    positions = int(vc.get("num_position_embeddings", 2304)) if qwen3 else 0
    if qwen3 and math.isqrt(positions) ** 2 != positions:
        raise ModelConfigError(f"num_position_embeddings {positions} is not a square grid")
    hidden = int(vc.get("hidden_size", 1152 if qwen3 else 1280))
    depth = int(vc.get("depth", vc.get("num_hidden_layers", 27 if qwen3 else 32)))
    deepstack = tuple(int(i) for i in vc.get("deepstack_visual_indexes", (8, 16, 24))) if qwen3 else ()
    if any(not 0 <= i < depth for i in deepstack):
        raise ModelConfigError(f"deepstack_visual_indexes {list(deepstack)} must be blocks of the {depth}-block tower")
    return QwenVisionConfig(
        variant=variant,
        hidden_size=hidden,
        intermediate_size=int(vc.get("intermediate_size", 3420)),
        num_layers=depth,
        num_heads=int(vc.get("num_heads", vc.get("num_attention_heads", 16))),
        patch_size=int(vc.get("patch_size", 16 if qwen3 else 14)),
        temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
        in_channels=int(vc.get("in_channels", vc.get("in_chans", 3))),
        spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
        window_size=0 if qwen3 else int(vc.get("window_size", 112)),  # 0: every block attends over the whole image
        fullatt_block_indexes=() if qwen3 else tuple(int(i) for i in vc.get("fullatt_block_indexes", (7, 15, 23, 31))),
        out_hidden_size=int(vc.get("out_hidden_size", 3584)),
        hidden_act=act,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        num_position_embeddings=positions,
        deepstack_visual_indexes=deepstack,
    )


def parse_moonvit_config(vc: dict[str, Any], raw: dict[str, Any]) -> MoonViTConfig:
    merge = tuple(int(k) for k in vc.get("merge_kernel_size") or (2, 2))
    if merge != (2, 2):
        raise ModelConfigError(f"merge_kernel_size {merge} is not supported (only 2x2)")
    rope = vc.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ModelConfigError(f"vision rope_type {rope.get('rope_type')!r} is not supported (only axial)")
    hidden = int(vc.get("hidden_size", 1152))
    if int(raw.get("projection_hidden_size") or hidden) != hidden:
        raise ModelConfigError("projection_hidden_size must equal the vision hidden size")
    return MoonViTConfig(
        hidden_size=hidden,
        intermediate_size=int(vc.get("intermediate_size", 4304)),
        num_layers=int(vc.get("num_hidden_layers", 27)),
        num_heads=int(vc.get("num_attention_heads", 16)),
        patch_size=int(vc.get("patch_size", 14)),
        pos_emb_height=int(vc.get("pos_emb_height", 64)),
        pos_emb_width=int(vc.get("pos_emb_width", 64)),
        merge_kernel=(2, 2),
        hidden_act=vc.get("hidden_act", "gelu_pytorch_tanh"),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        projection_eps=float(raw.get("projection_layer_norm_eps", 1e-5)),
    )


@dataclass(frozen=True)
class ModelConfig:
    """A servable checkpoint: its registered architecture, the decoder and, for a VLM, the vision side."""

    arch: ModelArchitecture
    text: TextConfig
    vision: VisionConfig | MoonViTConfig | QwenVisionConfig | None = None  # None: a text-only LLM (requests skip the image stages)
    image_token_id: int | None = None
    vision_feature_layers: tuple[int, ...] = ()  # absolute hidden-state indices (0 = embeddings)
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # LLaVA-OneVision's anyres: tiles at the best of these (height, width) resolutions, after the base image
    image_grid_pinpoints: tuple[tuple[int, int], ...] = ()
    anyres_max_tiles: int = 0  # "anyres_max_N": an image's unpadded features are downsampled past N tiles' worth
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    @property
    def native_resolution(self) -> bool:
        """Images keep their size: how many tokens one costs is known once it is preprocessed."""
        return isinstance(self.vision, (MoonViTConfig, QwenVisionConfig))

    @property
    def anyres(self) -> bool:
        """LLaVA-OneVision: fixed-size tiles of the image at its best grid resolution, a count per image."""
        return bool(self.image_grid_pinpoints)

    @property
    def image_tokens_vary(self) -> bool:
        """An image's token count is known once it is preprocessed (native resolution or anyres tiling)."""
        return self.native_resolution or self.anyres

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens one image expands to (CLS dropped for the default strategy); 0 without
        vision or when the count depends on the image (native resolution)."""
        if self.vision is None or self.image_tokens_vary:
            return 0
        n = self.vision.num_patches + self.vision.class_token
        return n - 1 if self.vision_feature_select_strategy == "default" else n

    @property
    def vision_layers_needed(self) -> int:
        """Encoder layers to run: hidden state k is the output of layer k-1, later layers are unused
        (LLaVA); every layer (MoonViT, which reads the last)."""
        if isinstance(self.vision, (MoonViTConfig, QwenVisionConfig)):
            return self.vision.num_layers
        return max(self.vision_feature_layers, default=0)

    @property
    def spatial_merge_size(self) -> int:
        """Patches per side merged into one language-model token (native-resolution towers; 1 otherwise)."""
        return self.vision.spatial_merge_size if isinstance(self.vision, QwenVisionConfig) else (
            self.vision.merge_kernel[0] if isinstance(self.vision, MoonViTConfig) else 1)


def _windows(tc: dict[str, Any], family: TextFamily, num_layers: int) -> tuple[int | None, ...]:
    window = tc.get("sliding_window")
    if family.windows == "layer_types":
        if not tc.get("use_sliding_window", False) or window is None:
            return (None,) * num_layers
        types = tc.get("layer_types") or ["full_attention"] * num_layers
        return tuple(window if t == "sliding_attention" else None for t in types)
    if family.windows == "all" and window is not None:
        return (int(window),) * num_layers
    return (None,) * num_layers


def _rope_parameters(tc: dict[str, Any]) -> dict[str, Any]:
    params = dict(tc.get("rope_parameters") or tc.get("rope_scaling") or {})
    params.setdefault("rope_theta", tc.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    if params["rope_type"] == "mrope":  # Qwen2-VL's releases name M-RoPE as a type; its frequencies are default
        params["rope_type"] = "default"
    if params["rope_type"] == "yarn":
        params.setdefault("original_max_position_embeddings", tc.get("max_position_embeddings"))
    return params


def _mla(tc: dict[str, Any]) -> MLAConfig:
    q_rank = tc.get("q_lora_rank")
    return MLAConfig(q_lora_rank=int(q_rank) if q_rank else None, kv_lora_rank=int(tc["kv_lora_rank"]),
                     qk_nope_head_dim=int(tc["qk_nope_head_dim"]), qk_rope_head_dim=int(tc["qk_rope_head_dim"]),
                     v_head_dim=int(tc["v_head_dim"]))


def _moe(tc: dict[str, Any], family: TextFamily, layers: int) -> tuple[MoEConfig | None, tuple[bool, ...]]:
    experts = int(next((tc[k] for k in family.experts_keys if tc.get(k)), 0))
    if family.router is None or experts == 0:
        return None, ()
    if family.router == "softmax" and family.always_renormalize:  # Mixtral: experts as wide as the dense MLP
        moe = MoEConfig(experts, int(tc["num_experts_per_tok"]), int(tc["intermediate_size"]))
        return moe, (True,) * layers
    sigmoid = family.router == "sigmoid-grouped"
    moe = MoEConfig(
        num_experts=experts,
        experts_per_tok=int(tc["num_experts_per_tok"]),
        intermediate_size=int(tc["moe_intermediate_size"]),
        router=family.router,
        norm_topk_prob=family.renormalize_topk or bool(tc.get("norm_topk_prob", sigmoid)),
        routed_scaling_factor=float(tc.get("routed_scaling_factor", 1.0) or 1.0) if sigmoid else 1.0,
        n_group=int(tc.get("n_group") or 1) if sigmoid else 1,
        topk_group=int(tc.get("topk_group") or 1) if sigmoid else 1,
        n_shared_experts=int(tc.get("n_shared_experts") or 0) if sigmoid else 0,
    )
    if moe.num_experts % moe.n_group or moe.topk_group > moe.n_group:
        raise ModelConfigError(f"{experts} experts do not split into n_group={moe.n_group} groups with "
                               f"topk_group={moe.topk_group}")
    if sigmoid:  # DeepSeek: the first k layers stay dense, then every moe_layer_freq-th layer is sparse
        first, freq = int(tc.get("first_k_dense_replace") or 0), int(tc.get("moe_layer_freq") or 1)
        return moe, tuple(i >= first and i % freq == 0 for i in range(layers))
    skip, step = set(tc.get("mlp_only_layers") or ()), int(tc.get("decoder_sparse_step") or 1)
    return moe, tuple(i not in skip and (i + 1) % step == 0 for i in range(layers))


def parse_text_config(tc: dict[str, Any], family_name: str | None = None) -> TextConfig:
    model_type = family_name or tc.get("model_type", "llama")
    family = TEXT_FAMILIES.get(model_type)
    if family is None:
        raise ModelConfigError(f"unsupported text model_type {model_type!r}; supported: {', '.join(TEXT_MODEL_TYPES)}")
    heads = int(tc["num_attention_heads"])
    head_dim = tc.get("head_dim") or tc["hidden_size"] // heads
    layers = int(tc["num_hidden_layers"])
    qkv_bias = family.qkv_bias or bool(tc.get("attention_bias", False))
    act = tc.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"unsupported text hidden_act {act!r} (only silu)")
    mla = _mla(tc) if family.attention == "mla" else None
    if mla is not None and tc.get("attention_bias"):
        raise ModelConfigError("MLA with attention_bias is not supported")
    moe, moe_layers = _moe(tc, family, layers)
    return TextConfig(
        model_type=model_type,
        vocab_size=int(tc["vocab_size"]),
        hidden_size=int(tc["hidden_size"]),
        intermediate_size=int(tc["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads if mla else int(tc.get("num_key_value_heads") or heads),
        head_dim=mla.v_head_dim if mla else int(head_dim),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        rope_parameters=_rope_parameters(tc),
        max_position_embeddings=int(tc.get("max_position_embeddings", 4096)),
        attention_bias=qkv_bias,
        o_bias=not family.qkv_bias and bool(tc.get("attention_bias", False)),
        mlp_bias=bool(tc.get("mlp_bias", False)),
        layer_windows=_windows(tc, family, layers),
        tie_word_embeddings=bool(tc.get("tie_word_embeddings", False)),
        num_experts=moe.num_experts if moe else 0,
        experts_per_tok=moe.experts_per_tok if moe else 0,
        hidden_act=act,
        qk_norm=family.qk_norm,
        mla=mla,
        moe=moe,
        moe_layers=moe_layers,
        rope_interleave=bool(tc.get("rope_interleave", False)) if mla else False,
        **_mrope(tc, family, mla.qk_rope_head_dim if mla else int(head_dim)),
    )


def _mrope(tc: dict[str, Any], family: TextFamily, rope_dim: int) -> dict[str, Any]:
    """M-RoPE's frequency split from the config, checked against the head: {} for 1-D RoPE families."""
    if family.positions == "rope":
        return {}
    rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    section = tuple(int(s) for s in rope.get("mrope_section") or ())
    if len(section) != 3 or sum(section) != rope_dim // 2:
        raise ModelConfigError(f"mrope_section {list(section)} must be three counts summing to head_dim / 2 = "
                               f"{rope_dim // 2}")
    interleaved = family.positions == "mrope-interleaved" or bool(rope.get("mrope_interleaved", False))
    return {"mrope_section": section, "mrope_interleaved": interleaved}


def parse_vision_config(vc: dict[str, Any]) -> VisionConfig:
    kind = "siglip" if vc.get("model_type") == "siglip_vision_model" else "clip"
    return VisionConfig(
        hidden_size=int(vc.get("hidden_size", 1024)),
        intermediate_size=int(vc.get("intermediate_size", 4096)),
        num_layers=int(vc.get("num_hidden_layers", 24)),
        num_heads=int(vc.get("num_attention_heads", 16)),
        image_size=int(vc.get("image_size", 336)),
        patch_size=int(vc.get("patch_size", 14)),
        num_channels=int(vc.get("num_channels", 3)),
        layer_norm_eps=float(vc.get("layer_norm_eps", 1e-5)),
        hidden_act=vc.get("hidden_act", "gelu_pytorch_tanh" if kind == "siglip" else "quick_gelu"),
        kind=kind,
        pooling_head=kind == "siglip" and bool(vc.get("vision_use_head", True)),
    )


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """A config.json of any registered architecture (``models.architectures``)."""
    try:
        arch = resolve_architecture(raw)
    except UnknownArchitecture as exc:
        raise ModelConfigError(str(exc)) from None
    tc = arch.text_config(raw)
    # The config's own model_type names the decoder family (a Kimi-K2 config says DeepseekV3ForCausalLM
    # with model_type kimi_k2); one we do not know is refused, never read as the class's family.
    flat = tc is raw and arch.text_config_key is not None  # a composite's decoder fields at the top level
    family = arch.text_family if flat else (tc.get("model_type") or arch.text_family)
    text = parse_text_config(tc, family)
    if tc is not raw:  # a composite: its own setting decides too (saved with no lm_head when true)
        top = bool(raw.get("tie_word_embeddings", arch.tie_default))
        text = replace(text, tie_word_embeddings=top if arch.tie == "top" else top or text.tie_word_embeddings)
    eos = tc.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    if not arch.takes_images:
        return ModelConfig(arch=arch, text=text, eos_token_ids=eos_ids, raw=raw)
    if arch.vision in ("qwen2.5-vit", "qwen3-vit"):
        vision = parse_qwen_vision_config(raw.get("vision_config") or {}, "qwen3" if arch.vision == "qwen3-vit" else "qwen2.5")
        if vision.out_hidden_size != text.hidden_size:
            raise ModelConfigError(f"vision out_hidden_size {vision.out_hidden_size} must equal the text hidden size "
                                   f"{text.hidden_size}")
        return ModelConfig(arch=arch, text=text, vision=vision, image_token_id=int(raw.get("image_token_id", 151655)),
                           eos_token_ids=eos_ids, raw=raw)
    if arch.vision == "moonvit":
        return ModelConfig(arch=arch, text=text, vision=parse_moonvit_config(raw.get("vision_config") or {}, raw),
                           image_token_id=int(raw.get("image_token_id", raw.get("media_placeholder_token_id", 163605))),
                           eos_token_ids=eos_ids, raw=raw)
    vision = parse_vision_config(raw.get("vision_config") or {})
    layers = raw.get("vision_feature_layer", -2)
    layers = [layers] if isinstance(layers, int) else list(layers)
    n_states = vision.num_layers + 1
    absolute = tuple(l % n_states for l in layers)
    pinpoints, max_tiles = _anyres(raw) if arch.projector == "mlp2-anyres" else ((), 0)
    return ModelConfig(
        arch=arch,
        text=text,
        vision=vision,
        image_token_id=int(raw.get("image_token_id", raw.get("image_token_index", 32000))),
        vision_feature_layers=absolute,
        vision_feature_select_strategy=raw.get("vision_feature_select_strategy", "default"),
        projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        eos_token_ids=eos_ids,
        image_grid_pinpoints=pinpoints,
        anyres_max_tiles=max_tiles,
        raw=raw,
    )


def _anyres(raw: dict[str, Any]) -> tuple[tuple[tuple[int, int], ...], int]:
    """LLaVA-OneVision's tiling: the grid resolutions and the "anyres_max_N" cap, checked."""
    pinpoints = tuple((int(h), int(w)) for h, w in raw.get("image_grid_pinpoints") or ())
    if not pinpoints:
        raise ModelConfigError("image_grid_pinpoints is empty: anyres needs the grid resolutions")
    ratio = str(raw.get("vision_aspect_ratio", "anyres_max_9"))
    if not ratio.startswith("anyres_max_") or not ratio[len("anyres_max_"):].isdigit():
        raise ModelConfigError(f"vision_aspect_ratio {ratio!r} is not supported (anyres_max_N)")
    size = int((raw.get("vision_config") or {}).get("image_size", 384))
    if any(h % size or w % size for h, w in pinpoints):
        raise ModelConfigError(f"image_grid_pinpoints {list(pinpoints)} must be multiples of the tower's {size} px")
    return pinpoints, int(ratio[len("anyres_max_"):])


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """``model_dir/config.json`` as a dict, unvalidated (what `strata ops` inspects)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"no config.json in {model_dir}: is this a Hugging Face checkpoint directory?")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path} is not a JSON object")
    return raw


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate ``model_dir/config.json`` (works before the weights arrive)."""
    raw = read_config_json(model_dir)
    try:
        return parse_model_config(raw)
    except KeyError as exc:
        raise ModelConfigError(f"config.json is missing required field {exc}") from None

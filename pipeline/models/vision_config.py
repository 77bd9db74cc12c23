"""The vision side of a checkpoint's config: a CLIP or SigLIP tower (:class:`VisionConfig`), Kimi-K2.5's
MoonViT (:class:`MoonViTConfig`) or a Qwen-VL ViT (:class:`QwenVisionConfig`), and their parsers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.config_values import MAX_LAYERS, checked_size, size

W = "vision_config"  # where a bad size is named


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


def parse_qwen_vision_config(vc: dict[str, Any], variant: str, deepstack: bool = True) -> QwenVisionConfig:
    rope = vc.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ModelConfigError(f"vision rope_type {rope.get('rope_type')!r} is not supported (only axial)")
    qwen3 = variant == "qwen3"
    act = vc.get("hidden_act", "gelu_pytorch_tanh" if qwen3 else "silu")
    if not qwen3 and act != "silu":
        raise ModelConfigError(f"unsupported vision hidden_act {act!r} (Qwen2.5-VL's tower is SwiGLU: silu)")
    positions = size(vc, "num_position_embeddings", 2304, where=W) if qwen3 else 0
    if qwen3 and math.isqrt(positions) ** 2 != positions:
        raise ModelConfigError(f"num_position_embeddings {positions} is not a square grid")
    hidden = size(vc, "hidden_size", 1152 if qwen3 else 1280, where=W)
    depth = checked_size(vc.get("depth", vc.get("num_hidden_layers", 27 if qwen3 else 32)), "depth", maximum=MAX_LAYERS,
                         where=W)
    levels = tuple(int(i) for i in vc.get("deepstack_visual_indexes", (8, 16, 24))) if qwen3 and deepstack else ()
    if any(not 0 <= i < depth for i in levels):
        raise ModelConfigError(f"deepstack_visual_indexes {list(levels)} must be blocks of the {depth}-block tower")
    return QwenVisionConfig(
        variant=variant,
        hidden_size=hidden,
        intermediate_size=size(vc, "intermediate_size", 3420, where=W),
        num_layers=depth,
        num_heads=checked_size(vc.get("num_heads", vc.get("num_attention_heads", 16)), "num_heads", where=W),
        patch_size=size(vc, "patch_size", 16 if qwen3 else 14, where=W),
        temporal_patch_size=size(vc, "temporal_patch_size", 2, where=W),
        in_channels=checked_size(vc.get("in_channels", vc.get("in_chans", 3)), "in_channels", where=W),
        spatial_merge_size=size(vc, "spatial_merge_size", 2, where=W),
        window_size=0 if qwen3 else size(vc, "window_size", 112, where=W),  # 0: every block attends over the whole image
        fullatt_block_indexes=() if qwen3 else tuple(int(i) for i in vc.get("fullatt_block_indexes", (7, 15, 23, 31))),
        out_hidden_size=size(vc, "out_hidden_size", 3584, where=W),
        hidden_act=act,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        num_position_embeddings=positions,
        deepstack_visual_indexes=levels,
    )


def parse_moonvit_config(vc: dict[str, Any], raw: dict[str, Any]) -> MoonViTConfig:
    merge = tuple(int(k) for k in vc.get("merge_kernel_size") or (2, 2))
    if merge != (2, 2):
        raise ModelConfigError(f"merge_kernel_size {merge} is not supported (only 2x2)")
    rope = vc.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ModelConfigError(f"vision rope_type {rope.get('rope_type')!r} is not supported (only axial)")
    hidden = size(vc, "hidden_size", 1152, where=W)
    if int(raw.get("projection_hidden_size") or hidden) != hidden:
        raise ModelConfigError("projection_hidden_size must equal the vision hidden size")
    return MoonViTConfig(
        hidden_size=hidden,
        intermediate_size=size(vc, "intermediate_size", 4304, where=W),
        num_layers=size(vc, "num_hidden_layers", 27, maximum=MAX_LAYERS, where=W),
        num_heads=size(vc, "num_attention_heads", 16, where=W),
        patch_size=size(vc, "patch_size", 14, where=W),
        pos_emb_height=size(vc, "pos_emb_height", 64, where=W),
        pos_emb_width=size(vc, "pos_emb_width", 64, where=W),
        merge_kernel=(2, 2),
        hidden_act=vc.get("hidden_act", "gelu_pytorch_tanh"),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        projection_eps=float(raw.get("projection_layer_norm_eps", 1e-5)),
    )


def parse_vision_config(vc: dict[str, Any]) -> VisionConfig:
    kind = "siglip" if vc.get("model_type") == "siglip_vision_model" else "clip"
    return VisionConfig(
        hidden_size=size(vc, "hidden_size", 1024, where=W),
        intermediate_size=size(vc, "intermediate_size", 4096, where=W),
        num_layers=size(vc, "num_hidden_layers", 24, maximum=MAX_LAYERS, where=W),
        num_heads=size(vc, "num_attention_heads", 16, where=W),
        image_size=size(vc, "image_size", 336, where=W),
        patch_size=size(vc, "patch_size", 14, where=W),
        num_channels=size(vc, "num_channels", 3, where=W),
        layer_norm_eps=float(vc.get("layer_norm_eps", 1e-5)),
        hidden_act=vc.get("hidden_act", "gelu_pytorch_tanh" if kind == "siglip" else "quick_gelu"),
        kind=kind,
        pooling_head=kind == "siglip" and bool(vc.get("vision_use_head", True)),
    )

"""Vision kinds: a composite model's vision tower and projector, one object per kind.

A tower kind reads the composite's vision side of ``config.json`` (``settings``: the parsed tower, the
image token and, for LLaVA, the feature layers, projector settings and anyres tiling) and writes its rows
in ``strata ops`` (``rows``) from the same keys, so bring-up and the loader cannot disagree about what a
tower is. The towers: CLIP/SigLIP under LLaVA's two-layer projector (which may tile, ``ProjectorKind``),
MoonViT (Kimi-K2.5) and the Qwen-VL ViTs. Torch-free, like the other kinds; which torch module computes
a tower follows from the type of its parsed config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection

from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.vision_config import parse_moonvit_config, parse_qwen_vision_config, parse_vision_config

# (component, what the checkpoint asks for, what implements it here; None: nothing does)
Row = tuple[str, str, "str | None"]

CLIP_TYPES = ("clip_vision_model", "siglip_vision_model")
SELECT_STRATEGIES = ("default", "full")
NATIVE_PROCESSOR = "the checkpoint's transformers image processor (stages.native_preprocessor); video refused"


@dataclass(frozen=True)
class ProjectorKind:
    """How tower features become decoder embeddings."""

    name: str
    anyres: bool = False  # LLaVA-OneVision: the image is also tiled at its best grid resolution, a newline per row


MLP2 = ProjectorKind("2-layer MLP")  # LLaVA
MLP2_ANYRES = ProjectorKind("2-layer MLP", anyres=True)  # LLaVA-OneVision
PATCH_MERGER = ProjectorKind("patch merger")  # Kimi-K2.5, Qwen-VL: 2x2 groups of patches through an MLP


@dataclass(frozen=True)
class ClipTower:
    """A CLIP or SigLIP ViT whose chosen hidden state a LLaVA projector maps (fixed size: a count per image)."""

    name: str = "CLIP / SigLIP ViT"

    def settings(self, raw: dict[str, Any], projector: ProjectorKind) -> dict[str, Any]:
        vision = parse_vision_config(raw.get("vision_config") or {})
        layers = raw.get("vision_feature_layer", -2)
        layers = [layers] if isinstance(layers, int) else list(layers)
        pinpoints, max_tiles = anyres_tiling(raw) if projector.anyres else ((), 0)
        return dict(vision=vision, image_token_id=int(raw.get("image_token_id", raw.get("image_token_index", 32000))),
                    vision_feature_layers=tuple(layer % (vision.num_layers + 1) for layer in layers),
                    vision_feature_select_strategy=raw.get("vision_feature_select_strategy", "default"),
                    projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
                    projector_bias=bool(raw.get("multimodal_projector_bias", True)),
                    image_grid_pinpoints=pinpoints, anyres_max_tiles=max_tiles)

    def rows(self, raw: dict[str, Any], projector: ProjectorKind, activations: Collection[str]) -> list[Row]:
        vc = raw.get("vision_config") or {}
        vtype = vc.get("model_type", "clip_vision_model")
        strategy = raw.get("vision_feature_select_strategy", "default")
        act = raw.get("projector_hidden_act", "gelu")
        rows: list[Row] = [
            ("vision_tower", f"{vtype}, {vc.get('num_hidden_layers', '?')} layers, {vc.get('image_size', '?')} px / "
             f"patch {vc.get('patch_size', '?')}", "pipeline.models.vision (CLIP / SigLIP ViT)" if vtype in CLIP_TYPES
             else None),
            ("vision_features", f"feature layer {raw.get('vision_feature_layer', -2)}, select '{strategy}'",
             "pipeline.models.image_encoder" if strategy in SELECT_STRATEGIES else None),
            ("projector", f"{projector.name}, {act}", "pipeline.models.projector" if act in activations else None)]
        if projector.anyres:
            rows.append(("image_processor", f"anyres tiles over {len(raw.get('image_grid_pinpoints') or [])} grid "
                         f"resolutions, unpadded, {raw.get('vision_aspect_ratio', 'anyres_max_9')}, a newline per row",
                         "pipeline.models.anyres + the checkpoint's transformers image processor "
                         "(stages.anyres_preprocessor); video refused"))
        return rows


@dataclass(frozen=True)
class MoonViTTower:
    """Kimi-K2.5's native-resolution tower: 2-D RoPE, 2x2 patch merge."""

    name: str = "MoonViT"

    def settings(self, raw: dict[str, Any], projector: ProjectorKind) -> dict[str, Any]:
        return dict(vision=parse_moonvit_config(raw.get("vision_config") or {}, raw),
                    image_token_id=int(raw.get("image_token_id", raw.get("media_placeholder_token_id", 163605))))

    def rows(self, raw: dict[str, Any], projector: ProjectorKind, activations: Collection[str]) -> list[Row]:
        vc = raw.get("vision_config") or {}
        merge = vc.get("merge_kernel_size") or [2, 2]
        rope = (vc.get("rope_parameters") or {}).get("rope_type", "axial")
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        ok = list(merge) == [2, 2] and rope == "axial" and act in activations
        return [("vision_tower", f"MoonViT, {vc.get('num_hidden_layers', '?')} layers, native resolution, patch "
                 f"{vc.get('patch_size', 14)}, 2-D {rope} RoPE, {act}", "pipeline.models.vision_moonvit" if ok else None),
                ("vision_features", f"{merge[0]}x{merge[1]} patch merge, a variable number of tokens per image",
                 "pipeline.models.vision_moonvit" if list(merge) == [2, 2] else None),
                ("projector", f"{projector.name}: LayerNorm, 2-layer GELU MLP", "pipeline.models.projector"),
                ("image_processor", "native resolution (navit resize, pad to the merge grid, patchify)", NATIVE_PROCESSOR)]


@dataclass(frozen=True)
class QwenViTTower:
    """Qwen2.5-VL's windowed ViT or Qwen3-VL's (a learned position grid, DeepStack features)."""

    variant: str  # "qwen2.5" | "qwen3"
    name: str = "Qwen-VL ViT"
    deepstack: bool = True  # Qwen3-VL's DeepStack levels (Qwen3.5's tower is Qwen3-VL's without them)

    def settings(self, raw: dict[str, Any], projector: ProjectorKind) -> dict[str, Any]:
        vision = parse_qwen_vision_config(raw.get("vision_config") or {}, self.variant, self.deepstack)
        return dict(vision=vision, image_token_id=int(raw.get("image_token_id", 151655)))

    def rows(self, raw: dict[str, Any], projector: ProjectorKind, activations: Collection[str]) -> list[Row]:
        vc = raw.get("vision_config") or {}
        qwen3 = self.variant == "qwen3"
        rope = (vc.get("rope_parameters") or {}).get("rope_type", "axial")
        act = vc.get("hidden_act", "gelu_pytorch_tanh" if qwen3 else "silu")
        merge = vc.get("spatial_merge_size", 2)
        ok = rope == "axial" and (act in activations if qwen3 else act == "silu")
        if qwen3:
            tower = (f"Qwen3-VL ViT, {vc.get('depth', '?')} blocks, patch {vc.get('patch_size', 16)}, 2-D {rope} RoPE, "
                     f"learned position grid, {act}")
            features = (f"{merge}x{merge} patch merge + DeepStack from blocks {list(vc.get('deepstack_visual_indexes', []))}"
                        " into the first decoder layers") if self.deepstack else f"{merge}x{merge} patch merge"
            merger = f"{projector.name}: LayerNorm, 2-layer GELU MLP" + (
                " (and one per DeepStack level)" if self.deepstack else "")
        else:
            tower = (f"Qwen2.5-VL ViT, {vc.get('depth', '?')} blocks, patch {vc.get('patch_size', 14)}, 2-D {rope} RoPE, "
                     f"{vc.get('window_size', 112)} px windows (full in {list(vc.get('fullatt_block_indexes', []))})")
            features = f"{merge}x{merge} patch merge, a variable number of tokens per image"
            merger = f"{projector.name}: RMSNorm, 2-layer GELU MLP"
        return [("vision_tower", tower, "pipeline.models.vision_qwen (kernels.segment_attention)" if ok else None),
                ("vision_features", features, "pipeline.models.vision_qwen + pipeline.models.decoder (DeepStack)"
                 if qwen3 else "pipeline.models.vision_qwen"),
                ("projector", merger, "pipeline.models.projector"),
                ("image_processor", "native resolution within min/max pixels (per request: mm_processor_kwargs)",
                 NATIVE_PROCESSOR)]


VisionKind = ClipTower | MoonViTTower | QwenViTTower

CLIP = ClipTower()
MOONVIT = MoonViTTower()
QWEN2_5_VIT = QwenViTTower("qwen2.5")
QWEN3_VIT = QwenViTTower("qwen3")
QWEN3_5_VIT = QwenViTTower("qwen3", deepstack=False)  # Qwen3.5


def anyres_tiling(raw: dict[str, Any]) -> tuple[tuple[tuple[int, int], ...], int]:
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

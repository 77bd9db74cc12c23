"""How many parameters a model has, from its parsed config alone: the decoder (the shard plan's count for a
group of one), the vision tower as stored, the projector; and how many language-model tokens one image is."""

from __future__ import annotations

from strata.pipeline.models.anyres import anyres_grid
from strata.pipeline.models.model_config import ModelConfig, MoonViTConfig, QwenVisionConfig, TextConfig, VisionConfig
from strata.pipeline.parallel.shard_plan import ShardPlan

ModelShape = ModelConfig


def text_params(tc: TextConfig) -> int:
    """Decoder parameters: embeddings, attention (GQA or MLA), dense MLPs, routed + shared experts and
    routers, norms, lm_head unless tied; the shard plan's count for a group of one."""
    return ShardPlan(tc, 0, 1).num_params()


MOONVIT_MAX_SIDE = 512  # Kimi-K2.5's processor default: an image's longer side is resized to at most this
QWEN_VL_MAX_IMAGE_TOKENS = 16384  # the Qwen-VL processors' default max_pixels: 28*28*16384 (2.5), 32*32*16384 (3)


def image_tokens(shape: ModelShape, max_side: int = MOONVIT_MAX_SIDE) -> int:
    """Language-model tokens of one image: the fixed count (LLaVA), or at native resolution the count of
    the largest image the processor lets through (a square of ``max_side`` px, padded to the 2x2 merge
    grid of patches: one token per four patches)."""
    vc = shape.vision
    if isinstance(vc, MoonViTConfig):
        per_side = -(-max_side // (vc.patch_size * 2))  # merged cells per side, after padding
        return per_side * per_side
    if isinstance(vc, QwenVisionConfig):  # Qwen-VL: the processor's pixel ceiling, one token per merged cell
        return QWEN_VL_MAX_IMAGE_TOKENS
    if shape.anyres:  # LLaVA-OneVision: an image exactly the largest grid resolution's size
        return anyres_grid(shape).max_tokens()
    return shape.num_image_tokens


def vision_params(vc: VisionConfig | MoonViTConfig | QwenVisionConfig) -> int:
    """The tower as stored in the checkpoint (all layers, even those past the feature layer)."""
    if isinstance(vc, QwenVisionConfig):
        h, i = vc.hidden_size, vc.intermediate_size
        attention = (3 * h * h + 3 * h) + (h * h + h)
        if vc.variant == "qwen2.5":  # patch embedding without bias; RMSNorms, SwiGLU with biases
            return vc.patch_dim * h + vc.num_layers * (2 * h + attention + 2 * (h * i + i) + (i * h + h))
        g, d = h * vc.merge_group, vc.out_hidden_size  # Qwen3-VL: LayerNorms, GELU MLPs, a position grid, DeepStack
        per_layer = 4 * h + attention + (h * i + i) + (i * h + h)
        deepstack = vc.deepstack_levels * (2 * g + g * g + g + g * d + d)
        return vc.patch_dim * h + h + vc.num_position_embeddings * h + vc.num_layers * per_layer + deepstack
    if isinstance(vc, MoonViTConfig):
        h, i = vc.hidden_size, vc.intermediate_size
        embed = 3 * vc.patch_size**2 * h + h + vc.pos_emb_height * vc.pos_emb_width * h
        per_layer = 2 * 2 * h + 4 * (h * h + h) + (h * i + i) + (i * h + h)
        return embed + vc.num_layers * per_layer + 2 * h
    h, i = vc.hidden_size, vc.intermediate_size
    per_layer = 4 * (h * h + h) + 2 * 2 * h + (h * i + i) + (i * h + h)
    patch = h * vc.num_channels * vc.patch_size**2
    if not vc.class_token:  # SigLIP: a patch bias, no class token or pre-norm; a post-norm and the pooling head
        head = h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * i + i) + (i * h + h) if vc.pooling_head else 0
        return patch + h + vc.num_patches * h + vc.num_layers * per_layer + 2 * h + head
    embeddings = patch + (vc.num_patches + 1) * h + h
    return embeddings + 2 * h + vc.num_layers * per_layer + 2 * h


def projector_params(cfg: ModelConfig) -> int:
    """Two linears: concatenated vision features -> text hidden -> text hidden (LLaVA); Kimi's patch
    merger: a LayerNorm, then 4 x vision hidden -> itself -> text hidden."""
    if isinstance(cfg.vision, (MoonViTConfig, QwenVisionConfig)):  # Qwen's merger: an RMSNorm (no bias)
        v, d = cfg.vision.hidden_size, cfg.text.hidden_size
        g = v * cfg.vision.merge_group
        norm = v if isinstance(cfg.vision, QwenVisionConfig) and cfg.vision.variant == "qwen2.5" else 2 * v
        return norm + g * g + g + g * d + d
    d_in, d = cfg.vision.hidden_size * len(cfg.vision_feature_layers), cfg.text.hidden_size
    return d_in * d + d * d + 2 * d * cfg.projector_bias + d * cfg.anyres  # OneVision's image_newline


def count_params(shape: ModelShape) -> int:
    if shape.vision is not None:
        return text_params(shape.text) + vision_params(shape.vision) + projector_params(shape)
    return text_params(shape.text)

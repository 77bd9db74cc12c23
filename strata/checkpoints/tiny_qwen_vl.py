"""Tiny Qwen-VL checkpoints made by transformers' own classes: ``Qwen2_5_VLForConditionalGeneration``
(a windowed native-resolution ViT with its 2x2 merger over a Qwen2 decoder with M-RoPE) and its
``Qwen2_5_VLProcessor`` (``Qwen2VLImageProcessor``: resize within ``min_pixels``/``max_pixels`` to
multiples of 28, flattened two-frame patches; the tokenizer; a chat template), saved with
``save_pretrained`` in Qwen's release layout. ``max_pixels`` bounds an image after resizing; the window
(56 px = two merged tokens a side) is small so that tiny images already span several windows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from strata.checkpoints.tiny_model import CHAT_TEMPLATE, IMAGE, INIT_RANGE, train_tokenizer, write_sha256sums
from strata.checkpoints.tiny_text_models import make_text_config, save_tiny_vlm

QWEN2_5_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=14, temporal_patch_size=2,
                      spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1], hidden_act="silu",
                      initializer_range=INIT_RANGE)
# M-RoPE over a 16-dim head: 8 frequencies, 2 temporal, 3 height, 3 width (Qwen2.5-VL-7B: 16/24/24 of 64)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}


def build_tiny_qwen2_5_vl(out_dir: str | Path, seed: int = 0, max_pixels: int = 224 * 224,
                          min_pixels: int = 28 * 28, text: dict[str, Any] | None = None,
                          vision: dict[str, Any] | None = None) -> Path:
    """``text`` / ``vision``: config fields over the tiny ones (the benchmarks' larger models)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(512, 4096)
    text_config = make_text_config("qwen2", len(tok), {"rope_parameters": MROPE, **(text or {})}).to_dict()
    text_config.pop("model_type", None)
    vision_config = {**QWEN2_5_VISION, **(vision or {}), "out_hidden_size": text_config["hidden_size"]}
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config,
                              image_token_id=tok.convert_tokens_to_ids(IMAGE), tie_word_embeddings=False)
    save_tiny_vlm(Qwen2_5_VLForConditionalGeneration, config, out_dir, seed, text_config)
    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, merge_size=2,
                                            temporal_patch_size=2)
    video_processor = Qwen2VLVideoProcessor(patch_size=14, merge_size=2, temporal_patch_size=2)  # Strata refuses video
    Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                        chat_template=CHAT_TEMPLATE).save_pretrained(out_dir)
    write_sha256sums(out_dir)
    return out_dir


# Qwen3-VL: 16 px patches, a learned 4x4 position grid, GELU blocks; DeepStack from blocks 0 and 1 into
# decoder layers 0 and 1
QWEN3_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=16, temporal_patch_size=2,
                    spatial_merge_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 1],
                    hidden_act="gelu_pytorch_tanh", initializer_range=INIT_RANGE)
QWEN3_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=4096, initializer_range=INIT_RANGE, rms_norm_eps=1e-6,
                  rope_parameters={**MROPE, "mrope_interleaved": True})
QWEN3_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1])


def build_tiny_qwen3_vl(out_dir: str | Path, seed: int = 0, moe: bool = False, max_pixels: int = 256 * 256,
                        min_pixels: int = 32 * 32) -> Path:
    """Qwen3-VL (``moe``: Qwen3-VL-MoE, softmax top-2 of 4 experts, layer 1 dense) and its processor."""
    return _qwen3_vision_model("Qwen3VLMoe" if moe else "Qwen3VL", {**QWEN3_TEXT, **(QWEN3_MOE if moe else {})},
                               QWEN3_VISION, out_dir, seed, max_pixels, min_pixels)


def _qwen3_vision_model(prefix: str, text: dict[str, Any], vision: dict[str, Any], out_dir: str | Path, seed: int,
                        max_pixels: int, min_pixels: int) -> Path:
    """A transformers ``{prefix}ForConditionalGeneration`` of these configs, with the Qwen3-VL processor."""
    import transformers
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl import Qwen3VLProcessor, Qwen3VLVideoProcessor

    from strata.checkpoints.tiny_model import BOS, EOS, PAD, SPECIAL_TOKENS

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(512, 4096)
    ids = dict(bos_token_id=SPECIAL_TOKENS.index(BOS), eos_token_id=SPECIAL_TOKENS.index(EOS),
               pad_token_id=SPECIAL_TOKENS.index(PAD))
    text = {**text, "vocab_size": len(tok), **ids}
    config = getattr(transformers, f"{prefix}Config")(
        text_config=text, vision_config={**vision, "out_hidden_size": text["hidden_size"]},
        image_token_id=tok.convert_tokens_to_ids(IMAGE), tie_word_embeddings=False)
    save_tiny_vlm(getattr(transformers, f"{prefix}ForConditionalGeneration"), config, out_dir, seed, text)
    image_processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=16, merge_size=2,
                                            temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video_processor = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)  # Strata refuses video
    Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                     chat_template=CHAT_TEMPLATE).save_pretrained(out_dir)
    write_sha256sums(out_dir)
    return out_dir


# Qwen3.5: Qwen3-VL's tower without DeepStack over a Qwen3-Next-style hybrid (3 linear layers, then a gated
# attention layer); interleaved M-RoPE over a quarter of each 32-dim head: 4 frequencies, 2 temporal, 1 height, 1 width
QWEN3_5_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=4096,
                    initializer_range=INIT_RANGE, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                     "mrope_interleaved": True, "partial_rotary_factor": 0.25})
QWEN3_5_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=32)


def build_tiny_qwen3_5(out_dir: str | Path, seed: int = 0, moe: bool = False, max_pixels: int = 256 * 256,
                       min_pixels: int = 32 * 32) -> Path:
    """Qwen3.5 (``moe``: Qwen3.5-MoE, every layer top-2 of 4 experts with a gated shared expert) and its
    processor (Qwen3-VL's, as Qwen ships it)."""
    vision = {k: v for k, v in QWEN3_VISION.items() if k != "deepstack_visual_indexes"}
    return _qwen3_vision_model("Qwen3_5Moe" if moe else "Qwen3_5", {**QWEN3_5_TEXT, **(QWEN3_5_MOE if moe else {})},
                               vision, out_dir, seed, max_pixels, min_pixels)

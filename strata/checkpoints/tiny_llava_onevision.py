"""A tiny LLaVA-OneVision checkpoint made by transformers' own classes: ``LlavaOnevisionForConditionalGeneration``
(a SigLIP tower, LLaVA's projector with ``image_newline``, a Qwen2 decoder) and its ``LlavaOnevisionProcessor``
(anyres tiling over ``image_grid_pinpoints``), saved with ``save_pretrained`` in the llava-hf layout. The
tower sees 56 px (4x4 patches of 14), tiles up to 3x3; "anyres_max_4" makes an image of more than four
tiles' worth of features downsample, so that path runs too.
"""

from __future__ import annotations

from pathlib import Path

from strata.checkpoints.tiny_model import CHAT_TEMPLATE, IMAGE, INIT_RANGE, train_tokenizer, write_sha256sums
from strata.checkpoints.tiny_text_models import make_text_config, save_tiny_vlm

TILE = 56
PINPOINTS = [[TILE * a, TILE * b] for a in (1, 2, 3) for b in (1, 2, 3)]
SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, image_size=TILE, patch_size=14, initializer_range=INIT_RANGE)


def build_tiny_llava_onevision(out_dir: str | Path, seed: int = 0, aspect_ratio: str = "anyres_max_4") -> Path:
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision import (LlavaOnevisionImageProcessor, LlavaOnevisionProcessor,
                                                     LlavaOnevisionVideoProcessor)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(512, 4096)
    text = make_text_config("qwen2", len(tok)).to_dict()
    config = LlavaOnevisionConfig(text_config=text, vision_config=dict(SIGLIP), image_token_id=tok.convert_tokens_to_ids(IMAGE),
                                  image_grid_pinpoints=PINPOINTS, vision_aspect_ratio=aspect_ratio, vision_feature_layer=-1,
                                  vision_feature_select_strategy="full", tie_word_embeddings=False)
    save_tiny_vlm(LlavaOnevisionForConditionalGeneration, config, out_dir, seed, text)
    size = {"height": TILE, "width": TILE}
    image_processor = LlavaOnevisionImageProcessor(size=size, crop_size=size, image_grid_pinpoints=PINPOINTS)
    video_processor = LlavaOnevisionVideoProcessor(size=size)  # saved for the processor; Strata refuses video
    LlavaOnevisionProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                            chat_template=CHAT_TEMPLATE, num_image_tokens=(TILE // 14) ** 2,
                            vision_feature_select_strategy="full", vision_aspect_ratio=aspect_ratio).save_pretrained(out_dir)
    write_sha256sums(out_dir)
    return out_dir

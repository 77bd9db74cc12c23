"""A tiny Kimi-K2.5 checkpoint made by transformers' own classes: ``Kimi_K25ForConditionalGeneration``
(MoonViT tower, patch-merger projector, a DeepSeek-V3 decoder with MLA and grouped MoE) and its
``Kimi_K25Processor`` (native-resolution image processor, the tokenizer, the chat template), saved with
``save_pretrained``. ``max_side`` bounds an image's longer side in pixels after resizing (the real model
allows 512 x 16384 patches); images of other sizes and aspect ratios become other token counts.
"""

from __future__ import annotations

from pathlib import Path

from strata.checkpoints.tiny_model import CHAT_TEMPLATE, IMAGE, INIT_RANGE, train_tokenizer, write_sha256sums
from strata.checkpoints.tiny_text_models import make_text_config, save_tiny_vlm

VISION = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=4,
              num_hidden_layers=2, hidden_size=32, intermediate_size=64, hidden_act="gelu_pytorch_tanh",
              merge_kernel_size=[2, 2], rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
              initializer_range=INIT_RANGE)


def build_tiny_kimi_k25(out_dir: str | Path, seed: int = 0, max_side: int = 224) -> Path:
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration
    from transformers.models.kimi_k25 import Kimi_K25ImageProcessor, Kimi_K25Processor, Kimi_K25VideoProcessor

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(512, 4096)
    text = make_text_config("deepseek_v3", len(tok)).to_dict()
    config = Kimi_K25Config(text_config=text, vision_config=dict(VISION), projection_hidden_size=VISION["hidden_size"],
                            image_token_id=tok.convert_tokens_to_ids(IMAGE), tie_word_embeddings=False)
    save_tiny_vlm(Kimi_K25ForConditionalGeneration, config, out_dir, seed, text)
    image_processor = Kimi_K25ImageProcessor(size={"max_height": max_side, "max_width": max_side}, patch_size=14,
                                             merge_size=2)
    video_processor = Kimi_K25VideoProcessor(patch_size=14, merge_size=2)  # saved for the processor; Strata refuses video
    Kimi_K25Processor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                      chat_template=CHAT_TEMPLATE).save_pretrained(out_dir)
    write_sha256sums(out_dir)
    return out_dir

"""bf16 weights and KV against transformers in bf16: per-position greedy agreement (teacher-forced on
transformers' own generation) of at least 95% over the four architectures, logits cosine >= 0.999, and
the vision tower's image features with cosine >= 0.999."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from helpers import build, sequence_logits
from strata.checkpoints.tiny_model import ARCHITECTURES

PROMPT = "Tell me a story about the sea and the stars."
NEW_TOKENS = 24


def _hf(path: Path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).eval(), AutoProcessor.from_pretrained(path)


@pytest.fixture(scope="module")
def agreement(tiny_models: dict[str, Path]) -> dict[str, tuple[int, int, float]]:
    """Per architecture: (positions whose argmax agrees, positions, mean logits cosine)."""
    results = {}
    for arch in ARCHITECTURES:
        hf, processor = _hf(tiny_models[arch])
        engine = build(tiny_models[arch], dtype="bfloat16")
        inputs = processor(text=engine.tokenizer.render_user_prompt(PROMPT), return_tensors="pt")
        n0 = inputs["input_ids"].shape[1]
        with torch.inference_mode():
            tokens = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0]
            ref = hf(input_ids=tokens[None]).logits[0].float()
        ours = sequence_logits(engine, tokens.tolist())
        rows = slice(n0 - 1, len(tokens) - 1)  # the positions that predicted each generated token
        agree = int((ours[rows].argmax(-1) == ref[rows].argmax(-1)).sum())
        cosine = float(F.cosine_similarity(ours[rows], ref[rows], dim=-1).mean())
        results[arch] = (agree, len(tokens) - n0, cosine)
    return results


def test_greedy_tokens_agree_on_95_percent_of_positions(agreement) -> None:
    agree = sum(a for a, _, _ in agreement.values())
    total = sum(n for _, n, _ in agreement.values())
    assert agree / total >= 0.95, agreement


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_cosine_is_at_least_0_999(arch: str, agreement) -> None:
    assert agreement[arch][2] >= 0.999, agreement[arch]


def test_the_vision_tower_in_bf16_matches_transformers(tiny_models, demo_images) -> None:
    from strata.pipeline.contract.config import EngineConfig
    from strata.stages.preprocessor import Preprocessor
    from strata.stages.vision_encoder import VisionEncoder

    path = tiny_models["llava-llama"]
    hf, processor = _hf(path)
    pixels = processor.image_processor(images=[Image.open(io.BytesIO(demo_images[0]))], return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        ref = hf.model.get_image_features(pixel_values=pixels.to(torch.bfloat16))
    ref = (ref.pooler_output if hasattr(ref, "pooler_output") else ref)
    ref = torch.cat(list(ref)) if isinstance(ref, (list, tuple)) else ref.reshape(-1, ref.shape[-1])
    encoder = VisionEncoder(path, EngineConfig(dtype="bfloat16"))
    ours = torch.from_numpy(encoder.encode([Preprocessor.from_model_dir(path).process(demo_images[0])])[0])
    cosine = F.cosine_similarity(ours.float(), ref.float().reshape(ours.shape), dim=-1)
    assert ours.shape == (hf.config.image_seq_length, hf.config.text_config.hidden_size)
    assert cosine.min() >= 0.999, cosine.min()

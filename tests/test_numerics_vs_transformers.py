"""Our model code equals transformers: same greedy tokens, logits within 1e-4 (fp32, CPU)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from helpers import build, greedy, prefill_logits
from strata.checkpoints.tiny_model import ARCHITECTURES

pytestmark = pytest.mark.usefixtures("attention_backend")  # fast and reference backends

PROMPT = "Tell me a story about the sea and the stars."
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            path = tiny_models[arch]
            cache[arch] = (LlavaForConditionalGeneration.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path))
        return cache[arch]

    return get


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_matches_transformers(arch: str, with_image: bool, tiny_models, reference, demo_images) -> None:
    hf, processor = reference(arch)
    engine = build(tiny_models[arch], prefill_chunk_tokens=512)
    images = demo_images[:1] if with_image else []
    text = engine.tokenizer.render_user_prompt(PROMPT, len(images))
    pil = [Image.open(io.BytesIO(b)) for b in images] or None
    inputs = processor(text=text, images=pil, return_tensors="pt")
    # The same prompt tokens the checkpoint's own processor produces.
    assert engine.tokenizer.encode(text, len(images)).token_ids == inputs["input_ids"][0].tolist()

    with torch.inference_mode():
        ref_logits = hf(**inputs).logits[0, -1].float()
        ref_tokens = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    ours = prefill_logits(engine, PROMPT, images)
    rel = (ours - ref_logits).abs().max() / ref_logits.abs().max()
    assert rel < 1e-4, f"prefill logits differ: max relative error {rel:.2e}"

    out = engine.generate([{"prompt": PROMPT, "images": images, "params": greedy(NEW_TOKENS)}])[0]
    assert out.output_token_ids == ref_tokens.tolist()
    assert len(set(out.output_token_ids)) > 3, "a degenerate model would make this comparison meaningless"


def test_sliding_window_is_exercised(tiny_models, reference) -> None:
    """Mistral's window (48) is shorter than this context, so a wrong window would change tokens."""
    hf, processor = reference("llava-mistral")
    engine = build(tiny_models["llava-mistral"], prefill_chunk_tokens=32)
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    text = engine.tokenizer.render_user_prompt(prompt)
    inputs = processor(text=text, return_tensors="pt")
    assert inputs["input_ids"].shape[1] > 2 * hf.config.text_config.sliding_window
    with torch.inference_mode():
        ref = hf.generate(**inputs, max_new_tokens=16, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    out = engine.generate([{"prompt": prompt, "params": greedy(16)}])[0]
    assert out.output_token_ids == ref.tolist()

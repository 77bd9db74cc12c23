"""Kimi-K2.5 with images, on a tiny checkpoint made by transformers' own Kimi_K25ForConditionalGeneration
and Kimi_K25Processor (saved in Moonshot's release layout: fused wqkv with paired RoPE dims, blocks,
norm0/fc0/wo, mm_projector.proj). Images keep their size: each becomes its own number of tokens, and
those counts reach tokenization, admission and the KV cache. Checked against transformers: `strata
align` at several sizes and aspect ratios (one image spans four KV blocks and three prefill chunks),
greedy tokens with one and two images, the preprocessor's patches and counts; and the engine's own
paths: the encoder cache, prefix hits by image, spill and reload, the hand-off, tp=2."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build, greedy, image_chat, patterned_image, spilling_engine, tokens_through_handoff
from PIL import Image

from strata.cli import main
from strata.pipeline.contract.config import EngineConfig
from strata.stages.native_preprocessor import NativeResolutionPreprocessor
from strata.checkpoints.tiny_kimi import build_tiny_kimi_k25

# (width, height) -> patch grid after the processor's resize (max side 224) and padding to 28 px:
# tokens = rows * cols / 4
SIZES = {"square-64": (64, 64), "wide-300x120": (300, 120), "tall-90x200": (90, 200), "large-224": (224, 224)}
PROMPT = "Describe the picture, then tell me about the sea."


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_kimi_k25(tmp_path_factory.mktemp("kimi") / "tiny-kimi-k25")


def _reference(model_dir: Path, images: list[bytes], n: int) -> tuple[list[int], int]:
    """transformers' greedy continuation and prompt length for PROMPT with ``images``."""
    from transformers import AutoProcessor, Kimi_K25ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": PROMPT}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=text, images=pil or None, return_tensors="pt")
    model = Kimi_K25ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
    prompt_len = inputs["input_ids"].shape[1]
    return out[0, prompt_len:].tolist(), prompt_len


@pytest.mark.parametrize("size", list(SIZES), ids=list(SIZES))
def test_align_passes_at_every_size(size: str, kimi_dir: Path, tmp_path: Path) -> None:
    image = tmp_path / "image.png"
    image.write_bytes(patterned_image(SIZES[size]))
    report = tmp_path / "align.json"
    code = main(["align", "--model", str(kimi_dir), "--image", str(image), "--json", str(report)])
    result = json.loads(report.read_text())
    assert code == 0, result
    points = [p["point"] for p in result["points"]]
    assert points[:3] == ["vision.0", "vision.1", "projector"] and points[-1] == "logits"


def test_the_preprocessor_gives_the_processors_patches_and_counts(kimi_dir: Path) -> None:
    from transformers import AutoImageProcessor

    ours = NativeResolutionPreprocessor(kimi_dir)
    theirs = AutoImageProcessor.from_pretrained(kimi_dir)
    counts = {}
    for name, size in SIZES.items():
        data = patterned_image(size)
        got = ours.process(data)
        ref = theirs(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
        assert got.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
        np.testing.assert_array_equal(got.pixel_values, ref["pixel_values"].numpy())
        counts[name] = got.num_tokens
    assert counts == {"square-64": 9, "wide-300x120": 55, "tall-90x200": 32, "large-224": 64}  # as the processor says


@pytest.mark.parametrize("sizes", [["large-224"], ["wide-300x120", "square-64"]], ids=["one-image", "two-images"])
def test_greedy_tokens_equal_transformers(sizes: list[str], kimi_dir: Path) -> None:
    """Prefill in 16-token chunks (they cut through the images), then decode."""
    images = [patterned_image(SIZES[s], i) for i, s in enumerate(sizes)]
    expected, prompt_len = _reference(kimi_dir, images, 10)
    engine = build(kimi_dir, prefill_chunk_tokens=16)
    out = engine.generate([{"prompt": PROMPT, "images": images, "params": greedy(10, ignore_eos=True)}])[0]
    assert out.error is None and out.num_prompt_tokens == prompt_len
    assert out.output_token_ids == expected


def test_the_same_image_is_encoded_once_and_hits_the_prefix_cache(kimi_dir: Path) -> None:
    engine = build(kimi_dir)
    image, other = patterned_image(SIZES["large-224"]), patterned_image(SIZES["large-224"], seed=7)
    request = {"prompt": PROMPT, "images": [image], "params": greedy(8)}
    first, second = engine.generate([request])[0], engine.generate([request])[0]
    assert second.output_token_ids == first.output_token_ids
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 64  # the image's 64 tokens and more
    assert engine.encoder.cache_hits == 1 and engine.encoder.cache_misses == 1
    third = engine.generate([{"prompt": PROMPT, "images": [other], "params": greedy(8)}])[0]
    assert third.num_cached_tokens < 16  # same text, another image of the same size: only the text before it


def test_spilled_image_blocks_reload_from_the_host_tier(kimi_dir: Path, tmp_path: Path) -> None:
    images = [patterned_image(SIZES["large-224"]), patterned_image(SIZES["wide-300x120"], 1)]
    request = {"prompt": PROMPT * 8, "images": images, "params": greedy(8)}
    expected = build(kimi_dir).generate([request])[0].output_token_ids
    engine = spilling_engine(kimi_dir, tmp_path / "host")
    out = engine.generate([request])[0]
    assert out.output_token_ids == expected and engine.kv.spills.peak > 4


def test_the_handoff_carries_image_requests(kimi_dir: Path, tmp_path: Path) -> None:
    images = [patterned_image(SIZES["tall-90x200"])]
    engine = build(kimi_dir)
    expected = engine.generate([{"prompt": PROMPT, "images": images, "params": greedy(10)}])[0].output_token_ids
    config = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "host"))
    assert tokens_through_handoff(kimi_dir, config, engine, images, PROMPT, greedy(10)) == expected


@pytest.mark.slow
def test_tp2_equals_tp1_with_images(kimi_dir: Path) -> None:
    request = {"prompt": PROMPT, "images": [patterned_image(SIZES["large-224"])], "params": greedy(10)}
    expected = build(kimi_dir).generate([request])[0].output_token_ids
    two = build(kimi_dir, tp=2)
    try:
        assert two.generate([request])[0].output_token_ids == expected
    finally:
        two.close()


@pytest.mark.slow
def test_the_openai_client_through_strata_serve_equals_the_engine(kimi_dir: Path, tmp_path: Path) -> None:
    """Aggregated serving (Preprocess, Encode, LLM): one image, two images of other sizes, and a video
    part, which is refused with a 400."""
    import openai
    from helpers import MODEL_NAME
    from serve_process import ServeProcess, stop_later

    engine = build(kimi_dir)
    cases = [[patterned_image(SIZES["large-224"])], [patterned_image(SIZES["wide-300x120"], 1), patterned_image(SIZES["square-64"], 2)]]
    expected = [engine.generate([{"prompt": PROMPT, "images": imgs, "params": greedy(10)}])[0] for imgs in cases]
    server = ServeProcess(kimi_dir, tmp_path, {"mode": "aggregated", "engine": {"max_model_len": 2048}})
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for imgs, exp in zip(cases, expected):
            reply = client.chat.completions.create(model=MODEL_NAME, messages=image_chat(imgs, PROMPT),
                                                   max_tokens=10, temperature=0)
            assert reply.choices[0].message.content == exp.text
            assert reply.usage.prompt_tokens == exp.num_prompt_tokens  # each image counted at its own size
        video = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, {"type": "text", "text": "?"}]
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": video}], max_tokens=4)
    finally:
        stop_later(server)


def test_the_planner_counts_the_tower_the_merger_and_image_tokens(kimi_dir: Path) -> None:
    from transformers import Kimi_K25ForConditionalGeneration

    from strata.planning.memory_plan import plan_memory

    plan = plan_memory(kimi_dir, 4096, 2, 1 << 30)
    model = Kimi_K25ForConditionalGeneration.from_pretrained(kimi_dir)
    routing_biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert plan.num_params == sum(p.numel() for p in model.parameters()) + routing_biases  # stored, so counted
    assert plan.multimodal and plan.image_tokens == 19 * 19  # a 512 px square: 38 x 38 patches, 2x2 merged
    assert plan.kv_bytes_per_token == 3 * (32 + 8) * 2  # MLA latent, bf16


@pytest.mark.parametrize("top, text, tied", [(True, False, True), (False, True, False), (None, False, True)])
def test_the_composite_configs_tie_setting_decides_the_lm_head(top, text, tied, kimi_dir: Path) -> None:
    """As transformers does for Kimi-K2.5: the top-level tie_word_embeddings (default true) wins."""
    from strata.pipeline.models.model_config import parse_model_config

    raw = json.loads((kimi_dir / "config.json").read_text())
    raw["text_config"]["tie_word_embeddings"] = text
    raw.pop("tie_word_embeddings", None)
    if top is not None:
        raw["tie_word_embeddings"] = top
    assert parse_model_config(raw).text.tie_word_embeddings is tied


def test_bad_images_are_refused_before_any_pixel_is_processed(kimi_dir: Path) -> None:
    """The native-resolution preprocessor keeps the guards every image passes: corrupt or empty bytes
    and an image over the pixel cap are an ImageError (a 400 when served), never a crash."""
    from strata.stages.preprocessor import ImageError

    pre = NativeResolutionPreprocessor(kimi_dir, max_pixels=100 * 100)
    for bad, message in ((b"", "empty"), (b"\x89PNG\r\n\x1a\n garbage", "decode|format"),
                         (patterned_image(SIZES["large-224"]), "pixels")):
        with pytest.raises(ImageError, match=message):
            pre.process(bad)
    assert pre.process(patterned_image(SIZES["square-64"])).num_tokens == 9  # and it still serves good ones
    engine = build(kimi_dir)
    with pytest.raises(ImageError):
        engine.add_request(PROMPT, images=[b"not an image"])
    assert not engine.has_unfinished()

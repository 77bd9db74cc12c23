"""Qwen2.5-VL on a tiny checkpoint made by transformers' own Qwen2_5_VLForConditionalGeneration and
Qwen2_5_VLProcessor (Qwen's release layout: model.layers, visual.blocks, visual.merger). Images keep
their size within the processor's pixel range (a request may move it: mm_processor_kwargs), the tower
attends in windows, and decoder positions are 3-D (M-RoPE). Checked against transformers: `strata align`
at several sizes and aspect ratios (one image spans several KV blocks and prefill chunks), the M-RoPE
positions, greedy tokens with one and two images; and the engine's own paths with the same tokens:
chunks cutting through images, preemption, spill and reload, the hand-off, tp=2, the prefix cache by
image and resolution, and the openai client through `strata serve`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (build, greedy, image_chat, patterned_image, preempting_engine, spilling_engine,
                     tokens_through_handoff)
from PIL import Image

from strata.cli import main
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.frontend.intake import PromptTooLongError
from strata.pipeline.models.mrope import MRopeLayout
from strata.stages.native_preprocessor import NativeResolutionPreprocessor
from strata.stages.preprocessor import ImageError
from strata.checkpoints.tiny_qwen_vl import build_tiny_qwen2_5_vl

# (width, height); the processor resizes to multiples of 28 within [28*28, 224*224] pixels: a token per 28x28
SIZES = {"square-64": (64, 64), "wide-300x120": (300, 120), "tall-90x200": (90, 200), "large-224": (224, 224)}
PROMPT = "Describe the picture, then tell me about the sea."


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen") / "tiny-qwen2.5-vl")


def _hf_inputs(model_dir: Path, images: list[bytes], **processor_kwargs):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": PROMPT}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return processor(text=text, images=pil or None, return_tensors="pt", **processor_kwargs)


def _reference(model_dir: Path, images: list[bytes], n: int) -> tuple[list[int], int]:
    """transformers' greedy continuation and prompt length for PROMPT with ``images``."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    inputs = _hf_inputs(model_dir, images)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
    prompt_len = inputs["input_ids"].shape[1]
    return out[0, prompt_len:].tolist(), prompt_len


@pytest.mark.parametrize("size", ["square-64", "wide-300x120", "tall-90x200"])
def test_align_passes_at_every_size(size: str, qwen_dir: Path, tmp_path: Path) -> None:
    """Every vision block (windowed and full), the merger, every decoder layer (M-RoPE) and the logits."""
    image = tmp_path / "image.png"
    image.write_bytes(patterned_image(SIZES[size]))
    report = tmp_path / "align.json"
    code = main(["align", "--model", str(qwen_dir), "--image", str(image), "--json", str(report)])
    result = json.loads(report.read_text())
    assert code == 0, result
    points = [p["point"] for p in result["points"]]
    assert points[:4] == ["vision.0", "vision.1", "vision.2", "projector"] and points[-1] == "logits"


def test_align_holds_the_bf16_contract(qwen_dir: Path, tmp_path: Path) -> None:
    """bf16 weights and KV against transformers in bf16: cosine >= 0.999 at every point, top-1 >= 0.9."""
    image = tmp_path / "image.png"
    image.write_bytes(patterned_image(SIZES["wide-300x120"]))
    assert main(["align", "--model", str(qwen_dir), "--image", str(image), "--dtype", "bfloat16"]) == 0


def test_mrope_positions_equal_transformers_and_any_chunk_of_them(qwen_dir: Path) -> None:
    """Our layout against transformers' get_rope_index for a prompt with two images of other shapes,
    whole and cut into chunks that start and end inside the images; generated tokens continue at
    index + delta."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    images = [patterned_image(SIZES["wide-300x120"]), patterned_image(SIZES["tall-90x200"], 1)]
    inputs = _hf_inputs(qwen_dir, images)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32)
    expected, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                 image_grid_thw=inputs["image_grid_thw"])
    ids = inputs["input_ids"][0].tolist()
    image_id = model.config.image_token_id
    offsets = [i for i, t in enumerate(ids) if t == image_id and (i == 0 or ids[i - 1] != image_id)]
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    layout = MRopeLayout((off, t * h * w // 4, (t, h, w)) for off, (t, h, w) in zip(offsets, grids))
    n = len(ids)
    np.testing.assert_array_equal(layout.positions(0, n), expected[:, 0].numpy())
    cuts = [0, offsets[0] + 3, offsets[1] - 1, offsets[1] + 5, n]
    pieces = np.concatenate([layout.positions(a, b) for a, b in zip(cuts, cuts[1:])], axis=1)
    np.testing.assert_array_equal(pieces, expected[:, 0].numpy())
    assert layout.delta == int(delta) < 0  # wide images: their rows and columns advance less than their tokens
    np.testing.assert_array_equal(layout.positions(n, n + 2), np.array([[n, n + 1]] * 3) + layout.delta)


def test_the_preprocessor_gives_the_processors_patches_counts_and_resolution(qwen_dir: Path) -> None:
    from transformers import AutoImageProcessor

    ours = NativeResolutionPreprocessor(qwen_dir)
    theirs = AutoImageProcessor.from_pretrained(qwen_dir)
    counts = {}
    for name, size in SIZES.items():
        data = patterned_image(size)
        got = ours.process(data)
        ref = theirs(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
        assert got.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
        np.testing.assert_array_equal(got.pixel_values, ref["pixel_values"].numpy())
        counts[name] = got.num_tokens
    assert counts == {"square-64": 4, "wide-300x120": 44, "tall-90x200": 21, "large-224": 64}  # as the processor says
    # a request's own pixel range, as vLLM's mm_processor_kwargs: the processor's result at that size
    data = patterned_image(SIZES["large-224"])
    small = ours.process(data, mm_processor_kwargs={"max_pixels": 16 * 28 * 28})
    ref = theirs(images=[Image.open(io.BytesIO(data)).convert("RGB")], size={"shortest_edge": 784,
                                                                            "longest_edge": 16 * 28 * 28},
                 return_tensors="pt")
    np.testing.assert_array_equal(small.pixel_values, ref["pixel_values"].numpy())
    assert small.num_tokens == 16 and small.content_hash != ours.process(data).content_hash


@pytest.mark.parametrize("kwargs, message", [
    ({"max_pixels": 100}, r"max_pixels must be an integer in \[784, "),
    ({"max_pixels": 1 << 40}, "max_pixels must be an integer"),
    ({"min_pixels": "784"}, "min_pixels must be an integer"),
    ({"min_pixels": 40000, "max_pixels": 30000}, r"min_pixels \(40000\) exceeds max_pixels \(30000\)"),
    ({"fps": 2}, r"unknown key\(s\) \['fps'\]"),
])
def test_bad_mm_processor_kwargs_are_refused_by_name(kwargs: dict, message: str, qwen_dir: Path) -> None:
    with pytest.raises(ImageError, match=message):
        NativeResolutionPreprocessor(qwen_dir).process(patterned_image(SIZES["square-64"]), mm_processor_kwargs=kwargs)


@pytest.mark.parametrize("sizes", [["large-224"], ["wide-300x120", "square-64"]], ids=["one-image", "two-images"])
def test_greedy_tokens_equal_transformers(sizes: list[str], qwen_dir: Path) -> None:
    """Prefill in 16-token chunks (they cut through the images), then decode at index + delta."""
    images = [patterned_image(SIZES[s], i) for i, s in enumerate(sizes)]
    expected, prompt_len = _reference(qwen_dir, images, 10)
    engine = build(qwen_dir, prefill_chunk_tokens=16)
    out = engine.generate([{"prompt": PROMPT, "images": images, "params": greedy(10, ignore_eos=True)}])[0]
    assert out.error is None and out.num_prompt_tokens == prompt_len
    assert out.output_token_ids == expected


def test_an_image_hits_the_prefix_cache_only_at_the_same_resolution(qwen_dir: Path) -> None:
    """The same image at the same size: encoded once, its blocks reused with cached_tokens reported. At
    another resolution it is another input: the encoder runs again, and no image block is reused, even
    though the placeholder tokens of a block look alike; the answer equals a fresh engine's."""
    image = patterned_image(SIZES["large-224"])
    request = {"prompt": PROMPT, "images": [image], "params": greedy(8)}
    engine = build(qwen_dir)
    first, second = engine.generate([request])[0], engine.generate([request])[0]
    assert second.output_token_ids == first.output_token_ids
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 64  # the image's 64 tokens and more
    assert engine.encoder.cache_hits == 1 and engine.encoder.cache_misses == 1
    smaller = {**request, "mm_processor_kwargs": {"max_pixels": 36 * 28 * 28}}
    third = engine.generate([smaller])[0]
    assert third.num_prompt_tokens == first.num_prompt_tokens - 64 + 36
    assert third.num_cached_tokens < 16 and engine.encoder.cache_misses == 2  # only text before the image
    assert third.output_token_ids == build(qwen_dir).generate([smaller])[0].output_token_ids


def test_preemption_recomputes_with_the_same_positions(qwen_dir: Path) -> None:
    images = [[patterned_image(SIZES["wide-300x120"], i)] for i in range(4)]
    requests = [{"prompt": PROMPT, "images": imgs, "params": greedy(30, ignore_eos=True)} for imgs in images]
    roomy = build(qwen_dir)
    alone = [roomy.generate([r])[0].output_token_ids for r in requests]
    engine = preempting_engine(qwen_dir)
    assert [o.output_token_ids for o in engine.generate(requests)] == alone
    assert engine.scheduler.num_preemptions > 0


def test_spilled_image_blocks_reload_from_the_host_tier(qwen_dir: Path, tmp_path: Path) -> None:
    images = [patterned_image(SIZES["large-224"]), patterned_image(SIZES["wide-300x120"], 1)]
    request = {"prompt": PROMPT * 8, "images": images, "params": greedy(8)}
    expected = build(qwen_dir).generate([request])[0].output_token_ids
    engine = spilling_engine(qwen_dir, tmp_path / "host")
    out = engine.generate([request])[0]
    assert out.output_token_ids == expected and engine.kv.spills.peak > 4


def test_the_handoff_carries_the_images_grids(qwen_dir: Path, tmp_path: Path) -> None:
    """Decode rebuilds the positions from the grids that travel with the images, and continues at delta."""
    images = [patterned_image(SIZES["tall-90x200"])]
    engine = build(qwen_dir)
    expected = engine.generate([{"prompt": PROMPT, "images": images, "params": greedy(10)}])[0].output_token_ids
    config = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "host"))

    def check(request, handoff) -> None:
        assert [tuple(i.grid_thw) for i in handoff.state.images] == [(1, 14, 6)]

    assert tokens_through_handoff(qwen_dir, config, engine, images, PROMPT, greedy(10), check) == expected


def test_a_prompt_too_long_for_its_images_says_what_they_cost(qwen_dir: Path) -> None:
    engine = build(qwen_dir, max_model_len=96)
    with pytest.raises(PromptTooLongError, match=r"prompt \(\d+ tokens, 108 of them for images\)"):
        engine.add_request(PROMPT, images=[patterned_image(SIZES["large-224"]), patterned_image(SIZES["wide-300x120"])],
                           params=greedy(8))
    assert not engine.has_unfinished()


@pytest.mark.slow
def test_tp2_equals_tp1_with_images(qwen_dir: Path) -> None:
    request = {"prompt": PROMPT, "images": [patterned_image(SIZES["wide-300x120"])], "params": greedy(10)}
    expected = build(qwen_dir).generate([request])[0].output_token_ids
    two = build(qwen_dir, tp=2)
    try:
        assert two.generate([request])[0].output_token_ids == expected
    finally:
        two.close()


def test_the_openai_client_through_strata_serve_equals_the_engine(qwen_vl_server) -> None:
    """Aggregated serving (Preprocess, Encode, LLM): one image, two images of other sizes, one image at a
    resolution the request chooses (mm_processor_kwargs), and such settings out of range: a 400."""
    import openai
    from helpers import MODEL_NAME

    engine = build(qwen_vl_server.model)
    small = {"max_pixels": 16 * 28 * 28}
    cases = [([patterned_image(SIZES["large-224"])], None), ([patterned_image(SIZES["wide-300x120"], 1), patterned_image(SIZES["square-64"], 2)], None),
             ([patterned_image(SIZES["large-224"])], small)]
    expected = [engine.generate([{"prompt": PROMPT, "images": imgs, "params": greedy(10), "mm_processor_kwargs": kw}])[0]
                for imgs, kw in cases]
    client = openai.OpenAI(base_url=qwen_vl_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(imgs: list[bytes], kwargs: dict | None):
        extra = {"mm_processor_kwargs": kwargs} if kwargs else None
        return client.chat.completions.create(model=MODEL_NAME, messages=image_chat(imgs, PROMPT),
                                              max_tokens=10, temperature=0, extra_body=extra)

    for (imgs, kwargs), exp in zip(cases, expected):
        reply = ask(imgs, kwargs)
        assert reply.choices[0].message.content == exp.text
        assert reply.usage.prompt_tokens == exp.num_prompt_tokens  # each image counted at its own size
    with pytest.raises(openai.BadRequestError, match="max_pixels must be an integer"):
        ask(cases[0][0], {"max_pixels": 10})


def test_qwens_own_flat_config_serves_the_same_tokens(qwen_dir: Path, tmp_path: Path) -> None:
    """Qwen's releases keep the decoder's fields at the top level with rope_scaling {"type": "mrope"}
    (transformers 5 nests them): both read as the same model."""
    import shutil

    flat_dir = tmp_path / "flat"
    shutil.copytree(qwen_dir, flat_dir)
    raw = json.loads((qwen_dir / "config.json").read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    raw.update({k: v for k, v in text.items() if k != "model_type"})
    raw["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    raw["rope_theta"] = rope["rope_theta"]
    (flat_dir / "config.json").write_text(json.dumps(raw))
    request = {"prompt": PROMPT, "images": [patterned_image(SIZES["wide-300x120"])], "params": greedy(8)}
    assert build(flat_dir).generate([request])[0].output_token_ids == build(qwen_dir).generate([request])[0].output_token_ids
    assert main(["ops", "--model", str(flat_dir)]) == 0


def test_ops_covers_it_and_the_planner_counts_every_parameter(qwen_dir: Path, tmp_path: Path) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from strata.planning.memory_plan import plan_memory

    report = tmp_path / "ops.json"
    assert main(["ops", "--model", str(qwen_dir), "--json", str(report)]) == 0
    needs = {c["name"]: c["need"] for c in json.loads(report.read_text())["components"]}
    assert "M-RoPE (t/h/w sections [2, 3, 3])" in needs["rope"] and "56 px windows" in needs["vision_tower"]
    plan = plan_memory(qwen_dir, 4096, 2, 1 << 30)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir)
    assert plan.num_params == sum(p.numel() for p in model.parameters())
    assert plan.multimodal and plan.image_tokens == 16384  # the processor's default ceiling: 28*28*16384 px


def test_packing_images_into_one_call_changes_no_embedding(qwen_dir: Path) -> None:
    """The encoder packs images of different sizes into calls of at most encoder_batch_patches patches
    (never padded): whatever the packing, each image's embeddings are its own, as if encoded alone."""
    from strata.stages.vision_encoder import VisionEncoder, patch_batches

    images = [NativeResolutionPreprocessor(qwen_dir).process(patterned_image(SIZES[s], i))
              for i, s in enumerate(["large-224", "square-64", "wide-300x120", "tall-90x200", "square-64"])]
    assert [len(b) for b in patch_batches(images, 300)] == [2, 3]  # 256 + 16 patches | 176 + 84 + 16
    assert [len(b) for b in patch_batches(images, 100)] == [1, 1, 1, 2]  # larger than the budget: alone
    results = []
    for budget in (0, 1, 300):
        encoder = VisionEncoder(qwen_dir, EngineConfig(encoder_batch_patches=budget))
        results.append(encoder.encode(images))
    for packed, alone in zip(results[0], results[1]):
        np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-5)
    for packed, alone in zip(results[2], results[1]):
        np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-5)

"""LLaVA-OneVision on a tiny checkpoint made by transformers' own LlavaOnevisionForConditionalGeneration and
LlavaOnevisionProcessor (llava-hf layout: a SigLIP tower, the projector, image_newline, a Qwen2 decoder).
An image becomes its base view plus tiles at the best of the grid resolutions; the tiles' features are
unpadded, downsampled past "anyres_max_4" and end each row with a newline, so each image costs its own
number of tokens. Checked against transformers: the token counts of the processor, `strata align` at
sizes that take each path (1x3 tiles, a tall image, a square one that downsamples), greedy tokens with
one and two images; and the engine's own paths: the prefix cache by image, spill and reload, the
hand-off, tp=2, and the openai client through `strata serve`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from helpers import build, greedy, image_chat, patterned_image, spilling_engine, tokens_through_handoff
from PIL import Image

from strata.cli import main
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.models.anyres import anyres_grid
from strata.pipeline.models.model_config import load_model_config
from strata.stages.anyres_preprocessor import AnyresPreprocessor
from strata.stages.preprocessor import ImageError
from strata.checkpoints.tiny_llava_onevision import build_tiny_llava_onevision

# (width, height): tiles of 56 px up to 3x3; a square of 224 px is 12x12 features, downsampled to 8x8
SIZES = {"tiny-40": (40, 40), "wide-300x120": (300, 120), "tall-90x200": (90, 200), "large-224": (224, 224)}
PROMPT = "Describe the picture, then tell me about the sea."


@pytest.fixture(scope="module")
def ov_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llava_onevision(tmp_path_factory.mktemp("onevision") / "tiny-llava-onevision")


def _inputs(model_dir: Path, images: list[bytes]):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": PROMPT}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return processor(text=text, images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")


def test_each_image_costs_what_the_processor_expands_it_to(ov_dir: Path) -> None:
    pre = AnyresPreprocessor(ov_dir, load_model_config(ov_dir))
    image_id = load_model_config(ov_dir).image_token_id
    counts = {}
    for name, size in SIZES.items():
        data = patterned_image(size)
        got = pre.process(data)
        ref = _inputs(ov_dir, [data])
        assert got.num_tokens == int((ref["input_ids"] == image_id).sum()), name
        assert got.image_size == tuple(ref["image_sizes"][0].tolist())
        assert torch.equal(torch.from_numpy(got.pixel_values), ref["pixel_values"][0][: got.pixel_values.shape[0]])
        counts[name] = got.num_tokens
    assert counts == {"tiny-40": 36, "wide-300x120": 68, "tall-90x200": 100, "large-224": 88}
    grid = anyres_grid(load_model_config(ov_dir))
    assert grid.max_tokens() == 105  # the planner's bound, which no image size exceeds
    assert max(grid.token_count(h, w) for h in range(10, 700, 9) for w in range(10, 700, 9)) <= grid.max_tokens()


@pytest.mark.parametrize("size", ["wide-300x120", "tall-90x200", "large-224"])
def test_align_passes_at_every_size(size: str, ov_dir: Path, tmp_path: Path) -> None:
    image = tmp_path / "image.png"
    image.write_bytes(patterned_image(SIZES[size]))
    report = tmp_path / "align.json"
    code = main(["align", "--model", str(ov_dir), "--image", str(image), "--json", str(report)])
    result = json.loads(report.read_text())
    assert code == 0, result
    assert [p["point"] for p in result["points"]][:3] == ["vision.0", "vision.1", "projector"]


def test_align_holds_the_bf16_contract(ov_dir: Path, tmp_path: Path) -> None:
    """bf16 weights and KV against transformers in bf16: cosine >= 0.999 at every point, top-1 >= 0.9."""
    image = tmp_path / "image.png"
    image.write_bytes(patterned_image(SIZES["wide-300x120"]))
    assert main(["align", "--model", str(ov_dir), "--image", str(image), "--dtype", "bfloat16"]) == 0


@pytest.mark.parametrize("sizes", [["large-224"], ["wide-300x120", "tall-90x200"]], ids=["one-image", "two-images"])
def test_greedy_tokens_equal_transformers(sizes: list[str], ov_dir: Path) -> None:
    """Prefill in 16-token chunks (they cut through the images' rows and newlines), then decode."""
    from transformers import LlavaOnevisionForConditionalGeneration

    images = [patterned_image(SIZES[s], i) for i, s in enumerate(sizes)]
    inputs = _inputs(ov_dir, images)
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(ov_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False, eos_token_id=None)
    prompt_len = inputs["input_ids"].shape[1]
    engine = build(ov_dir, prefill_chunk_tokens=16)
    ours = engine.generate([{"prompt": PROMPT, "images": images, "params": greedy(10, ignore_eos=True)}])[0]
    assert ours.error is None and ours.num_prompt_tokens == prompt_len
    assert ours.output_token_ids == out[0, prompt_len:].tolist()


def test_the_prefix_cache_spill_and_the_handoff_keep_the_tokens(ov_dir: Path, tmp_path: Path) -> None:
    image = patterned_image(SIZES["large-224"])
    request = {"prompt": PROMPT, "images": [image], "params": greedy(8)}
    engine = build(ov_dir)
    first, second = engine.generate([request])[0], engine.generate([request])[0]
    assert second.output_token_ids == first.output_token_ids
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 80
    assert engine.encoder.cache_hits == 1 and engine.encoder.cache_misses == 1
    long = {"prompt": PROMPT * 8, "images": [image, patterned_image(SIZES["tall-90x200"], 1)], "params": greedy(8)}
    spilling = spilling_engine(ov_dir, tmp_path / "host")
    assert spilling.generate([long])[0].output_token_ids == engine.generate([long])[0].output_token_ids
    assert spilling.kv.spills.peak > 4
    config = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "handoff"))
    assert tokens_through_handoff(ov_dir, config, engine, [image], PROMPT, greedy(8)) == first.output_token_ids


def test_bad_images_and_settings_are_refused(ov_dir: Path) -> None:
    pre = AnyresPreprocessor(ov_dir, load_model_config(ov_dir), max_pixels=100 * 100)
    for bad, kwargs, message in ((b"", None, "empty"), (patterned_image(SIZES["large-224"]), None, "pixels"),
                                 (patterned_image(SIZES["tiny-40"]), {"max_pixels": 1000}, "takes none")):
        with pytest.raises(ImageError, match=message):
            pre.process(bad, mm_processor_kwargs=kwargs)
    assert pre.process(patterned_image(SIZES["tiny-40"])).num_tokens == 36


def test_ops_covers_it_and_the_planner_counts_every_parameter(ov_dir: Path) -> None:
    from transformers import LlavaOnevisionForConditionalGeneration

    from strata.planning.memory_plan import plan_memory

    assert main(["ops", "--model", str(ov_dir)]) == 0
    plan = plan_memory(ov_dir, 4096, 2, 1 << 30)
    model = LlavaOnevisionForConditionalGeneration.from_pretrained(ov_dir)
    assert plan.num_params == sum(p.numel() for p in model.parameters())
    assert plan.multimodal and plan.image_tokens == 105


@pytest.mark.slow
def test_tp2_and_the_openai_client_through_strata_serve_equal_the_engine(ov_dir: Path, tmp_path: Path) -> None:
    import openai
    from helpers import MODEL_NAME
    from serve_process import ServeProcess, stop_later

    engine = build(ov_dir)
    cases = [[patterned_image(SIZES["large-224"])], [patterned_image(SIZES["wide-300x120"], 1),
                                                    patterned_image(SIZES["tiny-40"], 2)]]
    expected = [engine.generate([{"prompt": PROMPT, "images": imgs, "params": greedy(10)}])[0] for imgs in cases]
    two = build(ov_dir, tp=2)
    try:
        assert two.generate([{"prompt": PROMPT, "images": cases[1], "params": greedy(10)}])[0].output_token_ids == \
            expected[1].output_token_ids
    finally:
        two.close()
    server = ServeProcess(ov_dir, tmp_path, {"mode": "aggregated", "engine": {"max_model_len": 2048}})
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for imgs, exp in zip(cases, expected):
            reply = client.chat.completions.create(model=MODEL_NAME, messages=image_chat(imgs, PROMPT), max_tokens=10,
                                                   temperature=0)
            assert reply.choices[0].message.content == exp.text
            assert reply.usage.prompt_tokens == exp.num_prompt_tokens
    finally:
        stop_later(server)

"""Qwen3-VL and Qwen3-VL-MoE on tiny checkpoints made by transformers' own Qwen3VLForConditionalGeneration,
Qwen3VLMoeForConditionalGeneration and Qwen3VLProcessor. What they add to Qwen2.5-VL: interleaved M-RoPE,
a tower with a learned position grid and no windows, DeepStack (features of two vision blocks, each
through its own merger, added to the first two decoder layers' outputs at the image's rows), and for
the MoE a Qwen3-MoE decoder whose router always renormalises. Checked against transformers with `strata
align` and greedy tokens; DeepStack's features then ride every path a prompt takes: prefill chunks that
cut through an image, preemption, spill and reload, the hand-off, tp=2 and `strata serve`."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (build, greedy, image_chat, patterned_image, preempting_engine, spilling_engine,
                     tokens_through_handoff)
from PIL import Image

from strata.cli import main
from strata.pipeline.contract.config import EngineConfig
from strata.checkpoints.tiny_qwen_vl import build_tiny_qwen3_vl

# (width, height); the processor resizes to multiples of 32 within [32*32, 256*256] pixels: a token per 32x32
SIZES = {"square-64": (64, 64), "wide-300x120": (300, 120), "tall-90x200": (90, 200), "large-256": (256, 256)}
PROMPT = "Describe the picture, then tell me about the sea."
KINDS = ("dense", "moe")


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3")
    return {kind: build_tiny_qwen3_vl(root / f"tiny-qwen3-vl-{kind}", moe=kind == "moe") for kind in KINDS}


def _reference(model_dir: Path, images: list[bytes], n: int) -> tuple[list[int], int]:
    """transformers' greedy continuation and prompt length for PROMPT with ``images``."""
    import transformers
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": PROMPT}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images],
                       return_tensors="pt")
    name = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, name).from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
    prompt_len = inputs["input_ids"].shape[1]
    return out[0, prompt_len:].tolist(), prompt_len


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", ["square-64", "wide-300x120", "tall-90x200"])
def test_align_passes_at_every_size(kind: str, size: str, qwen3_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Every vision block, the merger, every decoder layer (DeepStack added after the first two) and the logits."""
    image = tmp_path / "image.png"
    image.write_bytes(patterned_image(SIZES[size]))
    report = tmp_path / "align.json"
    code = main(["align", "--model", str(qwen3_dirs[kind]), "--image", str(image), "--json", str(report)])
    result = json.loads(report.read_text())
    assert code == 0, result
    points = [p["point"] for p in result["points"]]
    assert points[:4] == ["vision.0", "vision.1", "vision.2", "projector"] and "decoder.2" in points


def test_align_holds_the_bf16_contract(qwen3_dirs: dict[str, Path], tmp_path: Path) -> None:
    """bf16 weights and KV against transformers in bf16: cosine >= 0.999 at every point, top-1 >= 0.9."""
    image = tmp_path / "image.png"
    image.write_bytes(patterned_image(SIZES["wide-300x120"]))
    assert main(["align", "--model", str(qwen3_dirs["moe"]), "--image", str(image), "--dtype", "bfloat16"]) == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sizes", [["large-256"], ["wide-300x120", "square-64"]], ids=["one-image", "two-images"])
def test_greedy_tokens_equal_transformers(kind: str, sizes: list[str], qwen3_dirs: dict[str, Path]) -> None:
    """Prefill in 16-token chunks: they cut through the images, so each chunk adds its own rows' DeepStack."""
    images = [patterned_image(SIZES[s], i) for i, s in enumerate(sizes)]
    expected, prompt_len = _reference(qwen3_dirs[kind], images, 10)
    engine = build(qwen3_dirs[kind], prefill_chunk_tokens=16)
    out = engine.generate([{"prompt": PROMPT, "images": images, "params": greedy(10, ignore_eos=True)}])[0]
    assert out.error is None and out.num_prompt_tokens == prompt_len
    assert out.output_token_ids == expected


def test_the_image_and_its_deepstack_hit_the_prefix_cache(qwen3_dirs: dict[str, Path]) -> None:
    engine = build(qwen3_dirs["dense"])
    request = {"prompt": PROMPT, "images": [patterned_image(SIZES["large-256"])], "params": greedy(8)}
    first, second = engine.generate([request])[0], engine.generate([request])[0]
    assert second.output_token_ids == first.output_token_ids
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 64
    assert engine.encoder.cache_hits == 1 and engine.encoder.cache_misses == 1


def test_preemption_and_spill_keep_the_tokens(qwen3_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Recomputed after preemption, or read back from the host tier: DeepStack rows land where they did."""
    model = qwen3_dirs["moe"]
    requests = [{"prompt": PROMPT, "images": [patterned_image(SIZES["wide-300x120"], i)], "params": greedy(30, ignore_eos=True)}
                for i in range(4)]
    roomy = build(model)
    alone = [roomy.generate([r])[0].output_token_ids for r in requests]
    engine = preempting_engine(model)
    assert [o.output_token_ids for o in engine.generate(requests)] == alone
    assert engine.scheduler.num_preemptions > 0
    long = {"prompt": PROMPT * 8, "images": [patterned_image(SIZES["large-256"]), patterned_image(SIZES["tall-90x200"], 1)],
            "params": greedy(8)}
    spilling = spilling_engine(model, tmp_path / "host")
    assert spilling.generate([long])[0].output_token_ids == roomy.generate([long])[0].output_token_ids
    assert spilling.kv.spills.peak > 4


def test_the_handoff_carries_deepstack_features(qwen3_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Decode may have to compute the prompt again (after a preemption), which needs the DeepStack features:
    they travel with the image, every level, and decode continues at the request's position delta."""
    model = qwen3_dirs["dense"]
    images = [patterned_image(SIZES["tall-90x200"])]
    engine = build(model)
    expected = engine.generate([{"prompt": PROMPT, "images": images, "params": greedy(10)}])[0].output_token_ids
    config = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "host"))

    def check(request, handoff) -> None:
        image = handoff.state.images[0]
        assert image.deepstack is not None and image.deepstack.shape == (2, image.length, 64)
        np.testing.assert_array_equal(image.deepstack, request.images[0].deepstack)

    assert tokens_through_handoff(model, config, engine, images, PROMPT, greedy(10), check) == expected


def test_the_releases_transposed_expert_tensors_load_the_same(qwen3_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Qwen3-VL-MoE's releases store experts as x @ W ([E, hidden, 2I], [E, I, hidden]); transformers 5
    writes W @ x. Both are the same model."""
    from safetensors.torch import load_file, save_file

    src = qwen3_dirs["moe"]
    release = tmp_path / "release"
    shutil.copytree(src, release)
    for shard in sorted(release.glob("*.safetensors")):
        tensors = load_file(shard)
        swapped = {k: (v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v)
                   for k, v in tensors.items()}
        save_file(swapped, str(shard), metadata={"format": "pt"})
    (release / "SHA256SUMS").unlink()
    request = {"prompt": PROMPT, "images": [patterned_image(SIZES["wide-300x120"])], "params": greedy(8)}
    assert build(release).generate([request])[0].output_token_ids == build(src).generate([request])[0].output_token_ids


@pytest.mark.parametrize("kind", KINDS)
def test_ops_covers_it_and_the_planner_counts_every_parameter(kind: str, qwen3_dirs: dict[str, Path]) -> None:
    import transformers

    from strata.planning.memory_plan import plan_memory

    model_dir = qwen3_dirs[kind]
    assert main(["ops", "--model", str(model_dir)]) == 0
    name = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, name).from_pretrained(model_dir)
    plan = plan_memory(model_dir, 4096, 2, 1 << 30)
    assert plan.num_params == sum(p.numel() for p in model.parameters())
    assert plan.multimodal and plan.image_tokens == 16384


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_tp2_equals_tp1_with_images(kind: str, qwen3_dirs: dict[str, Path]) -> None:
    request = {"prompt": PROMPT, "images": [patterned_image(SIZES["wide-300x120"])], "params": greedy(10)}
    expected = build(qwen3_dirs[kind]).generate([request])[0].output_token_ids
    two = build(qwen3_dirs[kind], tp=2)
    try:
        assert two.generate([request])[0].output_token_ids == expected
    finally:
        two.close()


@pytest.mark.slow
def test_the_openai_client_through_strata_serve_equals_the_engine(qwen3_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Aggregated serving of Qwen3-VL-MoE (Preprocess, Encode with DeepStack, LLM): one image, two images
    of other sizes, streamed and not."""
    import openai
    from helpers import MODEL_NAME
    from serve_process import ServeProcess, stop_later

    model = qwen3_dirs["moe"]
    engine = build(model)
    cases = [[patterned_image(SIZES["large-256"])], [patterned_image(SIZES["wide-300x120"], 1), patterned_image(SIZES["square-64"], 2)]]
    expected = [engine.generate([{"prompt": PROMPT, "images": imgs, "params": greedy(10)}])[0] for imgs in cases]
    server = ServeProcess(model, tmp_path, {"mode": "aggregated", "engine": {"max_model_len": 2048}})
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for imgs, exp in zip(cases, expected):
            messages = image_chat(imgs, PROMPT)
            reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
            assert reply.choices[0].message.content == exp.text
            assert reply.usage.prompt_tokens == exp.num_prompt_tokens
            stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                                    stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == exp.text
    finally:
        stop_later(server)


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl", "llava_onevision", "qwen3_vl", "kimi_k25"])
def test_whether_the_lm_head_is_the_embedding_follows_transformers(arch: str) -> None:
    """A composite's top-level tie_word_embeddings (a checkpoint saved with none of lm_head) and its text
    config's: either one ties LLaVA, Qwen2.5-VL and OneVision; only the top level ties Qwen3-VL and Kimi-K2.5
    (which ties by default), as transformers builds each class."""
    from strata.pipeline.models.architectures import ARCHITECTURES
    from strata.pipeline.models.model_config import parse_model_config

    cls = next(a for a in ARCHITECTURES.values() if a.model_type == arch)
    ties = {"llava": "either", "qwen2_5_vl": "either", "llava_onevision": "either", "qwen3_vl": "top", "kimi_k25": "top"}
    assert cls.tie == ties[arch]
    text = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1,
            "intermediate_size": 64, "vocab_size": 100}
    if arch == "kimi_k25":
        text = {**text, "model_type": "deepseek_v3", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                "v_head_dim": 8}
    if arch in ("qwen2_5_vl", "qwen3_vl"):
        text = {**text, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}, "head_dim": 16}
        text.pop("model_type")
    vision = {"out_hidden_size": 64}
    extra = {"image_grid_pinpoints": [[384, 384]]} if arch == "llava_onevision" else {}
    for top, inner in ((True, False), (False, True), (None, True), (None, False)):
        raw = {"architectures": [cls.name], "model_type": arch, "text_config": {**text, "tie_word_embeddings": inner},
               "vision_config": vision, **extra, **({} if top is None else {"tie_word_embeddings": top})}
        expected = (bool(top) or inner) if cls.tie == "either" else (top if top is not None else cls.tie_default)
        assert parse_model_config(raw).text.tie_word_embeddings is expected, (top, inner)

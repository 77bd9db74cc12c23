"""Qwen3.5 with images, dense and MoE, on tiny checkpoints made by transformers' own
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration and the Qwen3-VL processor Qwen ships it
with: Qwen3-VL's tower without DeepStack over the Qwen3-Next-style hybrid (Gated DeltaNet in three layers of
four), with interleaved M-RoPE over a quarter of each head. Greedy tokens equal transformers' with prefill chunks
that cut through the image and the recurrence; `strata align` passes in fp32; `strata ops` covers it; a prefix
hit and the hand-off carry the linear layers' state with the image's blocks; the openai client through
`strata serve` gets the engine's answers."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from helpers import build, greedy, patterned_image, tokens_through_handoff
from PIL import Image

from strata.checkpoints.tiny_qwen_vl import build_tiny_qwen3_5
from strata.cli import main
from strata.pipeline.contract.config import EngineConfig

PROMPT = "Describe the picture, then tell me about the sea."
KINDS = ("dense", "moe")


@pytest.fixture(scope="module")
def qwen3_5_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_5")
    return {kind: build_tiny_qwen3_5(root / kind, moe=kind == "moe") for kind in KINDS}


def _reference(model_dir: Path, images: list[bytes], n: int) -> list[int]:
    """transformers' greedy continuation of PROMPT after ``images``."""
    import transformers
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": PROMPT}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images] or None,
                       return_tensors="pt")
    name = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, name).from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sizes", [[(300, 120)], [], [(64, 64), (90, 200)]], ids=["one-image", "text", "two-images"])
def test_greedy_tokens_equal_transformers(kind: str, sizes: list, qwen3_5_dirs: dict[str, Path]) -> None:
    """8-token prefill chunks cut through the images (3-D positions) and the linear layers' recurrence."""
    images = [patterned_image(s, seed=i) for i, s in enumerate(sizes)]
    engine = build(qwen3_5_dirs[kind], prefill_chunk_tokens=8)
    out = engine.generate([{"prompt": PROMPT, "images": images, "params": greedy(10, ignore_eos=True)}])[0]
    assert out.error is None and out.output_token_ids == _reference(qwen3_5_dirs[kind], images, 10)


@pytest.mark.parametrize("kind", KINDS)
def test_align_passes_with_an_image(kind: str, qwen3_5_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Every vision block, the merger, every decoder layer and the logits, in fp32."""
    image = tmp_path / "image.png"
    image.write_bytes(patterned_image((300, 120)))
    report = tmp_path / "align.json"
    assert main(["align", "--model", str(qwen3_5_dirs[kind]), "--image", str(image), "--json", str(report)]) == 0
    points = [p["point"] for p in json.loads(report.read_text())["points"]]
    assert points[:4] == ["vision.0", "vision.1", "vision.2", "projector"] and "decoder.3" in points


@pytest.mark.parametrize("kind", KINDS)
def test_ops_covers_it(kind: str, qwen3_5_dirs: dict[str, Path], tmp_path: Path) -> None:
    report = tmp_path / "ops.json"
    assert main(["ops", "--model", str(qwen3_5_dirs[kind]), "--json", str(report)]) == 0
    rows = {r["name"]: r for r in json.loads(report.read_text())["components"]}
    assert "interleaved" in rows["rope"]["need"] and "over 0.25 of each head" in rows["rope"]["need"]
    assert "Gated DeltaNet on 3 of 4 layers" in rows["linear attention"]["need"]
    assert "DeepStack" not in rows["vision_features"]["need"]


def test_a_repeated_image_prompt_restores_state_and_blocks(qwen3_5_dirs: dict[str, Path]) -> None:
    """The same image and text again: blocks and the linear layers' state adopted up to the prompt's last
    block boundary, and the answer a fresh engine's; another image behind the same text hits nothing."""
    engine, fresh = build(qwen3_5_dirs["moe"]), build(qwen3_5_dirs["moe"])
    image, other = patterned_image((300, 120)), patterned_image((300, 120), seed=5)
    request = {"prompt": PROMPT, "images": [image], "params": greedy(8, ignore_eos=True)}
    first, again = engine.generate([request])[0], engine.generate([request])[0]
    assert again.output_token_ids == first.output_token_ids and again.num_cached_tokens > 0
    swapped = {**request, "images": [other]}
    out = engine.generate([swapped])[0]
    assert out.num_cached_tokens == 0 and out.output_token_ids == fresh.generate([swapped])[0].output_token_ids


def test_the_hand_off_carries_the_state_with_the_image(qwen3_5_dirs: dict[str, Path], tmp_path: Path) -> None:
    model = qwen3_5_dirs["dense"]
    engine, images = build(model), [patterned_image((300, 120))]
    want = engine.generate([{"prompt": PROMPT, "images": images, "params": greedy(10, ignore_eos=True)}])[0]
    config = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "host"))
    assert tokens_through_handoff(model, config, engine, images, PROMPT, greedy(10, ignore_eos=True)) == \
        want.output_token_ids


@pytest.mark.slow
def test_the_openai_client_through_strata_serve_equals_the_engine(qwen3_5_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Aggregated serving of Qwen3.5-MoE (Preprocess, Encode, LLM with the linear layers' state in its pool):
    one image and two of other sizes, streamed and not, two streams at once, equal the in-process engine."""
    import concurrent.futures

    import openai
    from helpers import MODEL_NAME, image_chat
    from serve_process import ServeProcess, stop_later

    model = qwen3_5_dirs["moe"]
    engine = build(model)
    cases = [[patterned_image((300, 120))], [patterned_image((64, 64), seed=1), patterned_image((90, 200), seed=2)]]
    expected = [engine.generate([{"prompt": PROMPT, "images": imgs, "params": greedy(10, ignore_eos=True)}])[0]
                for imgs in cases]
    assert all(e.text for e in expected) and expected[0].text != expected[1].text
    server = ServeProcess(model, tmp_path, {"mode": "aggregated", "engine": {"max_model_len": 2048}})
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(i: int, stream: bool) -> str:
            reply = client.chat.completions.create(model=MODEL_NAME, messages=image_chat(cases[i], PROMPT),
                                                   max_tokens=10, temperature=0, stream=stream,
                                                   extra_body={"ignore_eos": True})
            if stream:
                return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
            assert reply.usage.prompt_tokens == expected[i].num_prompt_tokens
            return reply.choices[0].message.content

        assert [ask(i, stream=False) for i in range(2)] == [e.text for e in expected]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda i: ask(i, stream=True), range(2))) == [e.text for e in expected]
    finally:
        stop_later(server)

"""Tiny LLaVA checkpoints are real, offline-loadable HF models, built deterministically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata.checkpoints.tiny_model import (
    ARCHITECTURES,
    TinyModelSpec,
    build_tiny_model,
    ensure_demo_model,
    make_demo_image,
    verify_sha256sums,
)

USER_IMAGE_MSG = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
]
EXPECTED_PROMPT = "<s>USER: <image>\nWhat is this? ASSISTANT:"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Build each architecture once per module; building dominates test time."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(TinyModelSpec(arch=arch), root / arch) for arch in ARCHITECTURES}


def _load(path: Path):
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return model, AutoProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def _shards(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_loads_offline_and_processes_image(arch: str, built: dict[str, Path], monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = built[arch]
    assert (path / "model.safetensors.index.json").is_file()
    assert len(_shards(path)) > 1, "tiny models must still be sharded"
    model, processor, tok = _load(path)
    cfg = model.config
    spec = TinyModelSpec(arch=arch)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert cfg.text_config.model_type == arch.removeprefix("llava-")
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<image>") == processor.image_token_id
    assert cfg.image_seq_length == spec.image_seq_length == 16
    assert cfg.vision_feature_layer == -2 and cfg.vision_feature_select_strategy == "default"
    assert cfg.tie_word_embeddings is False
    assert cfg.text_config.rope_parameters["rope_theta"] == 10000.0
    if arch == "llava-mistral":
        assert cfg.text_config.sliding_window == spec.sliding_window
        with torch.no_grad():  # longer than the window, so the sliding mask is really used
            logits = model(input_ids=torch.arange(5, 5 + 2 * spec.sliding_window)[None]).logits
        assert torch.isfinite(logits).all()
    if arch == "llava-mixtral":
        assert cfg.text_config.num_local_experts == spec.num_experts
        assert cfg.text_config.num_experts_per_tok == spec.experts_per_tok
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id, gen.do_sample) == (0, 1, 3, False)

    image = make_demo_image(tmp_path / "img.png", size=48)
    from PIL import Image

    prompt = processor.apply_chat_template(USER_IMAGE_MSG, add_generation_prompt=True)
    inputs = processor(images=Image.open(image), text=prompt, return_tensors="pt")
    ids = inputs["input_ids"][0]
    assert int((ids == cfg.image_token_id).sum()) == spec.image_seq_length
    assert ids[0].item() == tok.bos_token_id and int((ids == tok.bos_token_id).sum()) == 1
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[0] + 4


def test_chat_template_renders_llava_style(built: dict[str, Path]) -> None:
    _, processor, tok = _load(built["llava-llama"])
    for renderer in (tok, processor):
        assert renderer.apply_chat_template(USER_IMAGE_MSG, add_generation_prompt=True, tokenize=False) == EXPECTED_PROMPT
    convo = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tok.apply_chat_template(convo, tokenize=False)
    assert rendered == "<s>Be brief. USER: <image>\nHi ASSISTANT: Hello.</s>USER: Bye "


def test_tokenizer_special_ids_and_roundtrip(built: dict[str, Path]) -> None:
    _, _, tok = _load(built["llava-llama"])
    specials = ["<s>", "</s>", "<unk>", "<pad>", "<image>"]
    assert tok.convert_tokens_to_ids(specials) == [0, 1, 2, 3, 4]
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    text = "Héllo, wörld! 3.14 × 42 — ünïcode ✓ \t tabs\nnewlines 🦊"
    ids = tok(text)["input_ids"]
    assert tok.bos_token_id not in ids, "tokenizer must not prepend BOS; the template does"
    assert tok.decode(ids) == text
    prompt_ids = tok(EXPECTED_PROMPT)["input_ids"]
    assert prompt_ids[0] == 0 and prompt_ids.count(0) == 1 and prompt_ids.count(4) == 1


def test_same_seed_gives_identical_shards(built: dict[str, Path], tmp_path: Path) -> None:
    ref = built["llava-llama"]
    again = build_tiny_model(TinyModelSpec(seed=0), tmp_path / "again")
    assert _shards(again) == _shards(ref)
    assert (again / "SHA256SUMS").read_text() == (ref / "SHA256SUMS").read_text()
    listed = [line.split("  ")[1] for line in (ref / "SHA256SUMS").read_text().splitlines()]
    assert listed == sorted(_shards(ref))
    assert verify_sha256sums(again)
    other = build_tiny_model(TinyModelSpec(seed=1), tmp_path / "other")
    assert _shards(other) != _shards(ref)
    shard = sorted(again.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
    assert not verify_sha256sums(again)


def test_greedy_generation_is_not_degenerate(built: dict[str, Path]) -> None:
    varied = 0
    for arch in ARCHITECTURES:
        model, _, tok = _load(built[arch])
        inputs = tok("The quick brown fox", return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
            logits = model(input_ids=out).logits[0]
        new = out[0, inputs["input_ids"].shape[1] :].tolist()
        varied += len(set(new)) > 2
        top2 = logits.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).median()) > 1e-3, f"{arch}: near-tied logits"
    assert varied >= 3


def test_ensure_demo_model_is_built_once(tmp_path: Path) -> None:
    path = ensure_demo_model(tmp_path)
    assert path == tmp_path / "models" / "tiny-llava-llama-seed0"
    assert verify_sha256sums(path)
    stamp = (path / "config.json").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path) == path
    assert (path / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temp dirs left behind"


def test_demo_image_is_deterministic(tmp_path: Path) -> None:
    a = make_demo_image(tmp_path / "a.png")
    b = make_demo_image(tmp_path / "b.png")
    assert a.read_bytes() == b.read_bytes()
    from PIL import Image

    with Image.open(a) as img:
        assert img.mode == "RGB" and img.size == (64, 64)
        assert len(img.getcolors(64 * 64)) > 10


def test_the_catalog_names_each_tiny_architecture_once_and_refuses_others(tmp_path) -> None:
    from strata.checkpoints.catalog import LLAVA_ARCHITECTURES, TINY_ARCHITECTURES, VLM_BUILDERS, build_tiny
    from strata.checkpoints.tiny_text_models import TEXT_ARCHITECTURES

    assert len(set(TINY_ARCHITECTURES)) == len(TINY_ARCHITECTURES)
    assert set(TINY_ARCHITECTURES) == set(LLAVA_ARCHITECTURES) | set(TEXT_ARCHITECTURES) | set(VLM_BUILDERS)
    with pytest.raises(ValueError, match="unknown tiny architecture 'llava-gpt2'; known: llava-llama, "):
        build_tiny("llava-gpt2", tmp_path / "x")
    assert not (tmp_path / "x").exists()

"""`strata generate` streams text to stdout only, and bad input is one clear line, never a traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import build, greedy, run_strata


def strata(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return run_strata(*args, timeout=timeout)


def test_generate_streams_the_engine_output(llama_dir: Path, tmp_path: Path, demo_images) -> None:
    image = tmp_path / "img.png"
    image.write_bytes(demo_images[0])
    res = strata("generate", "--model", str(llama_dir), "--prompt", "Describe it.", "--image", str(image), "--max-tokens", "12")
    assert res.returncode == 0, res.stderr
    expected = "".join(build(llama_dir).stream(prompt="Describe it.", images=[demo_images[0]], params=greedy(12)))
    assert res.stdout == expected + "\n"


def test_raw_prompt_skips_the_chat_template(llama_dir: Path) -> None:
    res = strata("generate", "--model", str(llama_dir), "--raw-prompt", "USER: hi ASSISTANT:", "--max-tokens", "5")
    assert res.returncode == 0, res.stderr
    engine = build(llama_dir)
    expected = "".join(engine.stream(raw_prompt="USER: hi ASSISTANT:", params=greedy(5)))
    assert res.stdout == expected + "\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model", "--prompt", "hi"], "does not exist"),
        (["--prompt", "hi", "--image", "/no/such/image.png"], "cannot read image"),
        (["--prompt", "   "], "empty"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    ],
    ids=["missing-model", "missing-image", "empty-prompt", "bad-temperature"],
)
def test_bad_input_is_a_clear_error(args: list[str], message: str, llama_dir: Path) -> None:
    if "--model" not in args:
        args = ["--model", str(llama_dir), *args]
    res = strata("generate", *args)
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr
    assert res.stdout == ""


def test_unreadable_image_and_non_checkpoint_dir(llama_dir: Path, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not an image at all")
    res = strata("generate", "--model", str(llama_dir), "--prompt", "hi", "--image", str(garbage))
    assert res.returncode == 2 and "decode image" in res.stderr and "Traceback" not in res.stderr
    res = strata("generate", "--model", str(tmp_path), "--prompt", "hi")
    assert res.returncode == 2 and "config.json" in res.stderr and "Traceback" not in res.stderr


def test_make_tiny_model_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "m"
    res = strata("make-tiny-model", "--arch", "llava-qwen2", "--out", str(out), "--hidden", "32", "--layers", "1")
    assert res.returncode == 0, res.stderr
    assert (out / "config.json").is_file() and (out / "SHA256SUMS").is_file()
    engine = build(out)
    assert engine.model_config.text.model_type == "qwen2" and engine.model_config.text.hidden_size == 32


def test_generate_with_a_tiny_device_tier_spills_to_the_host_tier(llama_dir: Path, tmp_path: Path) -> None:
    prompt = "Tell me the whole story of the sea and the stars, from the start. " * 40
    config = tmp_path / "engine.json"
    config.write_text('{"engine": {"max_model_len": 2048, "prefill_chunk_tokens": 64}}')
    res = strata(
        "generate", "--model", str(llama_dir), "--prompt", prompt, "--max-tokens", "12", "--config", str(config),
        "--num-kv-blocks", "8", "--host-kv-blocks", "200", "--host-kv-dir", str(tmp_path / "host"),
    )
    assert res.returncode == 0, res.stderr
    expected = "".join(build(llama_dir, max_model_len=2048).stream(prompt=prompt, params=greedy(12)))
    assert res.stdout == expected + "\n"
    assert len(list((tmp_path / "host" / "blocks").rglob("*.kv"))) > 8  # the context really left the device


@pytest.mark.parametrize(
    "config, flags, message",
    [
        ("{not json", [], "not valid JSON"),
        ('{"engine": {"num_kv_blockz": 3}}', [], "unknown engine config keys: num_kv_blockz"),
        ("{}", ["--num-kv-blocks", "0"], "num_kv_blocks must be >= 1"),
        ("{}", ["--num-kv-blocks", "4"], "KV blocks but the device pool holds 4"),
    ],
    ids=["bad-json", "unknown-key", "zero-blocks", "pool-too-small"],
)
def test_bad_engine_config_is_a_clear_error(config: str, flags: list[str], message: str, llama_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "engine.json"
    path.write_text(config)
    res = strata("generate", "--model", str(llama_dir), "--prompt", "hi " * 40, "--config", str(path), *flags)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "config, message",
    [
        ("{oops", "not valid JSON"),
        ('{"stagez": {}}', "unknown serve config keys: stagez"),
        ('{"stages": {"prefill": {"max_replicaz": 2}}}', "unknown keys in stages.prefill: max_replicaz"),
        ('{"stages": {"warp": {}}}', "unknown stage 'warp'"),
        ('{"stages": {"decode": {"min_replicas": 3, "max_replicas": 2}}}', "min_replicas <= max_replicas"),
        ('{"mode": "disaggregated", "engine": {"host_kv_blocks": 0}}', "host_kv_blocks must be > 0"),
        ('{"mode": "pipelined"}', "mode must be one of"),
        ('{"stream_interval_ms": -1}', "stream_interval_ms"),
    ],
    ids=["bad-json", "unknown-key", "unknown-stage-key", "unknown-stage", "bad-bounds", "no-host-tier", "bad-mode",
         "bad-interval"],
)
def test_serve_refuses_a_bad_config_before_starting_anything(config: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "serve.json"
    path.write_text(config)
    res = strata("serve", "--config", str(path), "--port", "1")
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr

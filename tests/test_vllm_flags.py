"""`vllm serve`'s flags on `strata serve`, held to the table ``deployments.ray_serve.vllm_flags.FLAGS`` (and the
README's copy of it): each honoured flag lands in the serve config with vLLM's meaning, each refused one stops
`strata serve` before anything starts with one line saying why and what to use instead."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from strata.cli import main
from strata.deployments.ray_serve.serve_flags import add_arguments, load_config
from strata.deployments.ray_serve.vllm_flags import FLAGS

README = (Path(__file__).parents[1] / "README.md").read_text()

# flag (the table's key) -> (argv, the config field it sets, the value it holds)
HONOURED = {
    "--dtype auto/half/float16/bfloat16/float32": (["--dtype", "auto"], "engine.dtype", "float32"),
    "--enable-prefix-caching / --no-enable-prefix-caching": (["--no-enable-prefix-caching"],
                                                             "engine.enable_prefix_caching", False),
    "--max-num-seqs N": (["--max-num-seqs", "8"], "engine.max_num_seqs", 8),
    "--max-num-batched-tokens N": (["--max-num-batched-tokens", "512"], "engine.max_num_batched_tokens", 512),
    "--enable-auto-tool-choice": (["--enable-auto-tool-choice"], "tool_call_parser", "auto"),
    "--enable-tokenizer-info-endpoint": (["--enable-tokenizer-info-endpoint"], "enable_tokenizer_info_endpoint", True),
    "--limit-mm-per-prompt": (["--limit-mm-per-prompt", '{"image": 3}'], "engine.max_images_per_request", 3),
    "--chat-template FILE/TEMPLATE": (["--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"],
                                      "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    "--served-model-name NAME [ALIAS ...]": (["--served-model-name", "my-model", "alias"], "model_aliases", ["alias"]),
    "--reasoning-parser NAME": (["--reasoning-parser", "deepseek_r1"], "reasoning_parser", "deepseek_r1"),
    "--kv-cache-dtype auto/fp8/fp8_e4m3": (["--kv-cache-dtype", "fp8"], "engine.kv_cache_dtype", "fp8"),
    "--generation-config auto/vllm/FOLDER": (["--generation-config", "vllm"], "generation_config", "vllm"),
    "--tensor-parallel-size N": (["--tensor-parallel-size", "2"], "engine.tp", 2),
    "--speculative-config JSON": (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
                                  "engine.speculative.num_speculative_tokens", 2),
    "--model-impl auto/vllm/transformers": (["--model-impl", "vllm"], "engine.model_impl", "strata"),
}
REFUSED = {
    "--trust-remote-code": (["--trust-remote-code"], "Strata runs no checkpoint code"),
    "--gpu-memory-utilization F": (["--gpu-memory-utilization", "0.9"], "--kv-cache-memory"),
    "--pipeline-parallel-size N": (["--pipeline-parallel-size", "2"], "use --tensor-parallel-size"),
}


def test_every_flag_of_the_table_is_tested_and_in_the_readme() -> None:
    assert set(HONOURED) | set(REFUSED) == set(FLAGS)
    assert {f for f, (status, _) in FLAGS.items() if status == "refused"} == set(REFUSED)
    for flag, (status, _) in FLAGS.items():
        assert re.search(rf"\| `{re.escape(flag)}` \| {status} \|", README), f"README's vLLM flag table lacks {flag}"


@pytest.mark.parametrize("flag", HONOURED)
def test_an_honoured_flag_sets_the_config(flag: str, llama_dir: Path) -> None:
    argv, field, expected = HONOURED[flag]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    value = load_config(parser.parse_args(["--model", str(llama_dir), *argv]))
    for part in field.split("."):
        value = getattr(value, part)
    assert value == expected


@pytest.mark.parametrize("flag", REFUSED)
def test_a_refused_flag_is_one_line_and_nothing_starts(flag: str, llama_dir: Path, capsys) -> None:
    argv, words = REFUSED[flag]
    assert main(["serve", "--model", str(llama_dir), *argv, "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("argv, words", [
    (["--dtype", "half"], "dtype float16 runs on CUDA only"),
    (["--limit-mm-per-prompt", "video=1"], "takes images only, not video"),
    (["--limit-mm-per-prompt", "image=lots"], "neither image=N nor a JSON object"),
    (["--chat-template", "{{ oops"], "is not a Jinja template"),
])
def test_bad_values_of_them_are_one_line(argv: list[str], words: str, llama_dir: Path, capsys) -> None:
    assert main(["serve", "--model", str(llama_dir), *argv, "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_prefix_caching_is_on_unless_switched_off(llama_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert load_config(parser.parse_args(["--model", str(llama_dir)])).engine.enable_prefix_caching
    assert load_config(parser.parse_args(["--model", str(llama_dir), "--enable-prefix-caching"])).engine.enable_prefix_caching
    assert load_config(parser.parse_args(["--model", str(llama_dir), "--limit-mm-per-prompt", "image=2"])
                       ).engine.max_images_per_request == 2

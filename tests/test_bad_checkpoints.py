"""Checkpoints that cannot be served are refused by name, in one line, before anything is built: sizes that
are not positive integers (``num_hidden_layers: 1e12`` once built a trillion-entry tuple, ``0`` heads
divided by zero, a negative layer count planned negative blocks), sizes that do not divide, more layers than
the weights hold, a tokenizer config transformers cannot load, and an image processor whose patches are not
the tower's. ``strata plan``, ``generate`` and ``serve`` (before Ray starts) all say it the same way."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from helpers import run_strata

from strata.pipeline.models.model_config import ModelConfigError, load_model_config
from strata.stages.preflight import check_checkpoint


def _variant(src: Path, dst: Path, file: str, edit: Callable[[dict[str, Any]], None]) -> Path:
    shutil.copytree(src, dst)
    path = dst / file
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return dst


CONFIG_FAULTS = [
    ({"num_hidden_layers": 1e12}, "num_hidden_layers must be a positive integer, got 1000000000000.0"),
    ({"num_hidden_layers": 1e9}, "num_hidden_layers must be a positive integer"),
    ({"num_hidden_layers": -2}, "num_hidden_layers must be positive, got -2"),
    ({"num_hidden_layers": 100_000}, "num_hidden_layers is 100000; at most 4096"),
    ({"num_attention_heads": 0}, "num_attention_heads must be positive, got 0"),
    ({"num_attention_heads": 3, "head_dim": None}, "hidden_size (64) is not a multiple of num_attention_heads (3)"),
    ({"num_key_value_heads": 3}, "num_attention_heads (4) is not a multiple of num_key_value_heads (3)"),
    ({"vocab_size": "512"}, "vocab_size must be a positive integer, got '512'"),
    ({"intermediate_size": True}, "intermediate_size must be a positive integer, got True"),
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor 0.1 rotates 1 dims of a head: need an even count > 0"),
]


@pytest.mark.parametrize("edit, message", CONFIG_FAULTS, ids=[next(iter(e)) + f"-{i}" for i, (e, _) in enumerate(CONFIG_FAULTS)])
def test_a_config_size_that_makes_no_sense_is_refused_by_name(text_models: dict[str, Path], tmp_path: Path,
                                                                edit: dict[str, Any], message: str) -> None:
    model = _variant(text_models["llama"], tmp_path / "m", "config.json", lambda c: c.update(edit))
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model_config(model)


def test_more_layers_than_the_weights_hold_a_tokenizer_transformers_refuses_and_a_bad_processor(
        text_models: dict[str, Path], tmp_path: Path) -> None:
    layers = _variant(text_models["llama"], tmp_path / "layers", "config.json",
                      lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] + 6))
    with pytest.raises(ModelConfigError, match="decoder layers, but the weights hold 2"):
        check_checkpoint(layers)
    eos = _variant(text_models["llama"], tmp_path / "eos", "tokenizer_config.json", lambda c: c.update(eos_token=5))
    with pytest.raises(ModelConfigError, match="the tokenizer cannot be loaded .*eos_token"):
        check_checkpoint(eos)


def test_an_image_processor_whose_patches_are_not_the_towers_is_refused(tmp_path: Path) -> None:
    from strata.checkpoints.tiny_qwen_vl import build_tiny_qwen2_5_vl

    model = build_tiny_qwen2_5_vl(tmp_path / "qwen")
    check_checkpoint(model)  # as built: fine
    frames = _variant(model, tmp_path / "frames", "processor_config.json",
                      lambda c: c["image_processor"].update(temporal_patch_size=0))
    with pytest.raises(ModelConfigError, match="temporal_patch_size is 0, but the vision tower takes 2"):
        check_checkpoint(frames)


def test_a_template_that_fails_on_one_message_is_refused_at_start(text_models: dict[str, Path]) -> None:
    from strata.pipeline.frontend.tokenizer import PromptTokenizer

    tok = PromptTokenizer(text_models["llama"], load_model_config(text_models["llama"]),
                          "{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}")
    with pytest.raises(ValueError, match="fails on a one-message conversation: the chat template recursed"):
        tok.check_template()


def test_every_command_says_it_in_one_line(text_models: dict[str, Path], tmp_path: Path) -> None:
    model = _variant(text_models["llama"], tmp_path / "m", "config.json", lambda c: c.update(num_hidden_layers=1e12))
    for args in (["plan", "--model", str(model), "--context", "4096"],
                 ["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2"],
                 ["serve", str(model), "--port", "1"]):
        res = run_strata(*args, timeout=120)
        assert res.returncode == 2, (args, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert lines == ["strata: error: config.json: num_hidden_layers must be a positive integer, got 1000000000000.0"], \
            (args, res.stderr)
    template = tmp_path / "recursive.jinja"
    template.write_text("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}")
    res = run_strata("serve", str(text_models["llama"]), "--chat-template", str(template), "--port", "1", timeout=120)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "strata: error: the chat template fails on a one-message conversation: the chat template recursed too deeply "
        "rendering these messages"], res.stderr

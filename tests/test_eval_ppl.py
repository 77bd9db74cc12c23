"""`strata eval ppl`: Strata's perplexity next to transformers' on the same checkpoint (real SmolLM2 and a
tiny model, fp32 and bf16), against a saved reference (a perturbed copy of the weights fails it), and bad
input as one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from strata.checkpoints.tiny_model import write_sha256sums
from strata.cli import main

TEXT = ("The sea is calm tonight. The tide is full, the moon lies fair upon the straits; on the French coast "
        "the light gleams and is gone; the cliffs of England stand, glimmering and vast, out in the tranquil bay.")


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


def _ppl(capsys, *argv: str, json_path: Path) -> tuple[int, dict, str]:
    code = main(["eval", "ppl", *argv, "--json", str(json_path)])
    out = capsys.readouterr().out
    return code, json.loads(json_path.read_text()), out


def test_real_weights_agree_with_transformers(smollm2: Path, text_file: Path, tmp_path: Path, capsys) -> None:
    code, result, out = _ppl(capsys, "--model", str(smollm2), "--text", str(text_file), json_path=tmp_path / "r.json")
    assert code == 0 and result["pass"] and "PASS" in out
    assert abs(result["ratio"] - 1) < 1e-4 and 10 < result["strata_ppl"] < 1000 and result["tokens_scored"] > 40


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tiny_model_agrees_in_each_dtype(dtype: str, text_models, text_file: Path, tmp_path: Path, capsys) -> None:
    code, result, _ = _ppl(capsys, "--model", str(text_models["qwen3"]), "--text", str(text_file), "--dtype", dtype,
                           "--chunk", "7", json_path=tmp_path / "r.json")
    assert code == 0 and result["pass"]
    assert abs(result["ratio"] - 1) < (1e-4 if dtype == "float32" else 2e-2)


def test_perturbed_weights_fail_against_the_saved_reference(text_models, text_file: Path, tmp_path: Path,
                                                           capsys) -> None:
    """The reference is saved from the good weights; a copy with one projection scaled by 1.5 (what a loader
    that misreads a scale would compute) scores the same tokens worse, and the command says so with exit 1."""
    source = text_models["llama"]
    saved = tmp_path / "ref.json"
    code, _, _ = _ppl(capsys, "--model", str(source), "--text", str(text_file), "--save-reference", str(saved),
                      json_path=tmp_path / "a.json")
    assert code == 0 and saved.is_file()
    copy = tmp_path / "perturbed"
    shutil.copytree(source, copy)
    for shard in copy.glob("*.safetensors"):
        tensors = load_file(str(shard))
        hit = [k for k in tensors if k.endswith("layers.0.mlp.down_proj.weight")]
        if hit:
            tensors[hit[0]] = tensors[hit[0]] * 1.5
            save_file(tensors, str(shard), metadata={"format": "pt"})
    write_sha256sums(copy)  # a consistent checkpoint, only its numbers are off
    code, result, out = _ppl(capsys, "--model", str(copy), "--text", str(text_file), "--reference", str(saved),
                             json_path=tmp_path / "b.json")
    assert code == 1 and not result["pass"] and "FAIL" in out and "different weights" in out
    code, result, _ = _ppl(capsys, "--model", str(source), "--text", str(text_file), "--reference", str(saved),
                           json_path=tmp_path / "c.json")
    assert code == 0 and abs(result["ratio"] - 1) < 1e-4


@pytest.mark.parametrize("problem", ["missing", "empty", "other-tokens"])
def test_bad_input_is_one_line(problem: str, text_models, text_file: Path, tmp_path: Path, capsys) -> None:
    model = text_models["llama"]
    argv = ["eval", "ppl", "--model", str(model), "--text", str(text_file)]
    if problem == "missing":
        argv[-1] = str(tmp_path / "nowhere.txt")
    elif problem == "empty":
        text_file.write_text("")
    else:
        saved = tmp_path / "ref.json"
        assert main([*argv, "--save-reference", str(saved)]) == 0
        text_file.write_text(TEXT + " And more words.")
        argv += ["--reference", str(saved)]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and str(tmp_path) not in err, err

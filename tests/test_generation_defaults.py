"""``--generation-config`` (vLLM's meaning): the checkpoint's ``generation_config.json`` gives the default
sampling of a request that leaves a field out; a bad file stops the server in one line before it starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strata.cli import main
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.frontend.intake import Intake
from strata.pipeline.frontend.tokenizer import PromptTokenizer
from strata.pipeline.models.model_config import load_model_config
from strata.pipeline.frontend.generation_defaults import GenerationDefaults, load_generation_defaults

pytestmark = pytest.mark.unit


def _dir(tmp_path: Path, content: object, name: str = "model") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    path = folder / "generation_config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


def test_auto_reads_the_checkpoints_file_and_names_what_it_leaves_out(tmp_path: Path, caplog) -> None:
    model = _dir(tmp_path, {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                            "max_new_tokens": 64, "min_p": 0.05, "do_sample": False, "bos_token_id": 1})
    with caplog.at_level("WARNING"):
        got = load_generation_defaults("auto", model)
    assert got.applied() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                             "max_tokens": 64}
    assert got.ignored == ("min_p",) and "min_p" in caplog.text  # Strata's sampler has no min_p: said once
    assert load_generation_defaults("vllm", model) == GenerationDefaults()  # vllm: the server's own defaults
    other = _dir(tmp_path, {"temperature": 0.2}, "elsewhere")
    assert load_generation_defaults(str(other), model).temperature == 0.2  # a folder of one's own
    assert load_generation_defaults("auto", tmp_path) == GenerationDefaults()  # no file: nothing to apply


@pytest.mark.parametrize("content, words", [
    ("{not json", "is not valid JSON"),
    (b"\xff\xfe{", "is not valid JSON"),
    ([1, 2], "must hold a JSON object"),
    ({"temperature": 3.5}, "temperature must be a number in [0, 2]"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_p": 0}, "top_p must be a number in (0, 1]"),
    ({"top_k": 2.5}, "top_k must be an integer >= -1"),
    ({"repetition_penalty": True}, "repetition_penalty must be a number"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
])
def test_a_bad_file_is_a_one_line_error_naming_the_key(content: object, words: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="generation_config.json") as info:
        load_generation_defaults("auto", _dir(tmp_path, content))
    assert words in str(info.value) and "\n" not in str(info.value)


def test_strata_serve_refuses_a_bad_file_or_folder_before_starting(tmp_path: Path, llama_dir: Path, capsys) -> None:
    bad = _dir(tmp_path, {"temperature": 9})
    assert main(["serve", "--model", str(llama_dir), "--generation-config", str(bad), "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "temperature must be a number in [0, 2]" in err and len(err.splitlines()) == 1
    assert main(["serve", "--model", str(llama_dir), "--generation-config", str(tmp_path), "--port", "1"]) == 2
    assert "no generation_config.json in that folder" in capsys.readouterr().err


def _intake(model: Path, default_max_tokens: int) -> Intake:
    return Intake(PromptTokenizer(model, load_model_config(model)), EngineConfig(), default_max_tokens)


def test_max_new_tokens_bounds_a_request_without_max_tokens_within_its_room(llama_dir: Path) -> None:
    intake = _intake(llama_dir, 5)
    request, _ = intake.make_request("a", SamplingParams(max_tokens=None), prompt="hello")
    assert request.params.max_tokens == 5
    request, _ = intake.make_request("b", SamplingParams(max_tokens=9), prompt="hello")
    assert request.params.max_tokens == 9  # the request's own limit wins
    roomy = _intake(llama_dir, 10**6)
    request, _ = roomy.make_request("c", SamplingParams(max_tokens=None), prompt="hello")
    assert request.params.max_tokens == roomy.config.max_model_len - len(request.prompt_token_ids)

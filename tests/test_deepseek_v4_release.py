"""DeepSeek-V4 as released: FP8 attention and shared experts in blocks whose scales are e8m0 powers of two
(``<linear>.scale``), FP4 routed experts (int8 bytes of two e2m1 codes, an e8m0 scale per 32 inputs), the
compressors' projections dense. The copy of the tiny transformers-built V4 is written by transformers' FP8
quantizer and compressed-tensors' MXFP4 compressor (``strata.checkpoints.deepseek_v4_release``), never by Strata;
it generates what transformers generates on its exactly dequantized weights, and stays in its stored format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_generates_as_transformers, assert_tp2_equals_tp1, build, greedy

from strata.cli import main
from strata.kernels.quant_weight import FP8BlockWeight, MXFP4Weight
from strata.pipeline.models.model_loader import load_language_model
from strata.pipeline.models.quant_modules import quant_weights
from strata.pipeline.models.weights import WeightsError

PROMPTS = ["What is the capital of France? The quick brown fox jumps over the lazy dog.", "A short one."]


@pytest.fixture(scope="module")
def release(text_models, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(V4 in its release format with 16x16 FP8 blocks, its exact dequantization: the reference)."""
    from strata.checkpoints.deepseek_v4_release import dequantize_deepseek_v4_release, write_deepseek_v4_release

    root = tmp_path_factory.mktemp("v4-release")
    quantized = write_deepseek_v4_release(text_models["deepseek_v4"], root / "v4-fp8-fp4", block=16)
    return quantized, dequantize_deepseek_v4_release(quantized, root / "reference")


def test_the_reference_reads_the_release_as_transformers_does(release: tuple[Path, Path]) -> None:
    """transformers' own FP8/FP4 dequantizer gives the reference's weights bit for bit (whole blocks here, where
    its block-size guess is right), so the e2m1 nibble order and the e8m0 scales mean what they mean there."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from strata.checkpoints.quantized_checkpoint import read_tensors

    stored, dense = read_tensors(release[0]), read_tensors(release[1])
    scaled = [k.removesuffix(".scale") for k in stored if k.endswith(".scale") and f"{k[:-6]}.weight" in stored]
    kinds = {stored[f"{m}.weight"].dtype for m in scaled}
    assert kinds == {torch.float8_e4m3fn, torch.int8} and all(stored[f"{m}.scale"].dtype == torch.float8_e8m0fnu
                                                              for m in scaled)
    dequantize = Fp8Dequantize(None)._dequantize_one
    for module in scaled:
        theirs = dequantize(stored[f"{module}.weight"], stored[f"{module}.scale"], torch.float32)
        assert torch.equal(theirs, dense[f"{module}.weight"]), module


def test_generate_equals_transformers_on_the_dequantized_weights(release: tuple[Path, Path]) -> None:
    assert_generates_as_transformers(*release, PROMPTS)


def test_weights_stay_in_their_stored_format(release: tuple[Path, Path]) -> None:
    """Attention and shared experts hold FP8 blocks, routed experts FP4 bytes (the stack gate rows first), the
    compressors' projections stay dense; resident bytes within 5% of the checkpoint's codes and scales."""
    from strata.checkpoints.quantized_checkpoint import read_tensors

    model = build(release[0]).core.runner.model
    held = quant_weights(model)
    assert isinstance(held["layers.1.self_attn.o_a_proj.weight"], FP8BlockWeight)
    assert isinstance(held["layers.1.self_attn.compressor.indexer.q_b_proj.weight"], FP8BlockWeight)
    assert isinstance(held["layers.0.mlp.shared_experts.up_proj.weight"], FP8BlockWeight)
    assert isinstance(held["layers.0.mlp.experts.gate_up_proj"], MXFP4Weight)
    dense = dict(model.named_parameters())
    assert "layers.1.self_attn.compressor.kv_proj.weight" in dense and not set(held) & set(dense)
    stored = sum(t.numel() * t.element_size() for k, t in read_tensors(release[0]).items()
                 if t.dtype in (torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu))
    resident = sum(w.nbytes for w in held.values())
    assert stored * 0.95 <= resident <= stored * 1.05, (resident, stored)


@pytest.mark.slow
def test_tp2_equals_tp1(release: tuple[Path, Path]) -> None:
    """Each rank reads its block-aligned slices of the FP8 codes and scales, and its experts whole."""
    assert_tp2_equals_tp1(release[0], [{"prompt": p, "params": greedy(10 + i)} for i, p in enumerate(PROMPTS)])


def test_ops_names_each_format_and_claims_every_tensor(release: tuple[Path, Path], tmp_path: Path) -> None:
    """Scales and codes are claimed by their linears; the mHC's own ``scale`` parameters are not mistaken for any."""
    report = tmp_path / "ops.json"
    assert main(["ops", "--model", str(release[0]), "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["missing"] == [] and result["weights"]["unclaimed"] == []
    assert result["weights"]["reads"] == load_language_model(release[0])[1].tensors_read > 0
    lines = [c for c in result["components"] if c["name"].strip() in ("weight format", "stored")]
    assert lines[0]["need"] == "fp8: fp8-e4m3-block16x16, mxfp4-e2m1-group32"
    stored = {c["need"].split(" in ")[0]: c["need"].split(" in ")[1].split(" ")[0] for c in lines[1:]}
    assert stored["model.layers.*.ffn.experts.*.w1"] == "mxfp4-e2m1-group32"
    assert stored["model.layers.*.attn.wo_a"] == stored["model.layers.*.attn.indexer.wq_b"] == "fp8-e4m3-block16x16"
    assert not any("compressor" in name or "hc_" in name for name in stored)


def _with_config(src: Path, dst: Path, **quant: object) -> Path:
    shutil.copytree(src, dst)
    (dst / "SHA256SUMS").unlink()
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], **quant}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_an_unknown_expert_dtype_is_refused_in_one_line(release: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    copy = _with_config(release[0], tmp_path / "fp6", expert_dtype="fp6")
    capsys.readouterr()
    assert main(["generate", "--model", str(copy), "--prompt", "hi", "--max-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expert_dtype 'fp6' is not implemented" in err[0]


def test_fp4_experts_under_a_config_that_says_fp8_are_refused_by_name(release: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    """A config that misstates the experts' dtype would read FP4 bytes as FP8 codes: the load names the tensor."""
    copy = _with_config(release[0], tmp_path / "says-fp8", expert_dtype="fp8")
    with pytest.raises(WeightsError, match=r"experts\.\d+\.\w+\.weight is int8; its format stores float8_e4m3fn"):
        load_language_model(copy)


def test_v4_flash_is_planned_at_its_stored_bytes(tmp_path: Path) -> None:
    """At tp=8 each rank holds 32 of 256 experts per layer in FP4 (17/32 of a byte a weight) and its attention in
    FP8: under a third of the bf16 plan."""
    from strata.planning.memory_plan import plan_memory
    from strata.planning.model_shapes import BUILTIN_SHAPES

    GiB = 1 << 30
    bf16 = {k: v for k, v in BUILTIN_SHAPES["deepseek-v4-flash"].items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(bf16))
    stored = plan_memory("deepseek-v4-flash", 1_000_000, 1, 141 * GiB, block_size=128, tp=8)
    dense = plan_memory(str(tmp_path), 1_000_000, 1, 141 * GiB, block_size=128, tp=8)
    experts = 43 * 32 * 3 * 4096 * 2048  # one rank's routed-expert weights
    assert dense.weights_bytes - stored.weights_bytes >= experts * (2 - 17 / 32)
    assert stored.weights_bytes < dense.weights_bytes / 3

"""Checkpoints as they are released, quantized by compressed-tensors (never by Strata): DeepSeek-V3 in FP8
blocks with partial blocks, Kimi-K2.5's INT4 routed experts, MXFP4 experts, asymmetric INT4 everywhere and
per-channel FP8, MiniMax-M2 in FP8 blocks. Each generates exactly what transformers generates in fp32 on the exactly dequantized
weights, keeps its weights in their stored format, and is refused in one line when its config or its
tensors say something Strata does not read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_generates_as_transformers, assert_tp2_equals_tp1, build, greedy
from safetensors.torch import load_file, save_file

from strata.cli import main
from strata.kernels.quant_weight import QuantWeight
from strata.pipeline.models.model_loader import load_language_model
from strata.pipeline.models.quant_modules import quant_weights

PROMPTS = ["What is the capital of France? The quick brown fox jumps over the lazy dog.", "A short one."]
NAMES = ["deepseek_v3-fp8", "kimi_k25-int4", "qwen3_moe-mxfp4", "qwen3_moe-int4-asym", "llama-fp8-channel",
         "minimax_m2-fp8"]


@pytest.mark.parametrize("name", NAMES)
def test_generate_equals_transformers_on_the_dequantized_weights(name: str, quantized_models) -> None:
    assert_generates_as_transformers(*quantized_models[name], PROMPTS)


@pytest.mark.parametrize("name", NAMES)
def test_weights_stay_in_their_stored_format(name: str, quantized_models) -> None:
    """Every quantized linear holds its stored tensors (no dense copy), within 5% of the format's bytes;
    only MLA's kv_b_proj is expanded, once, for the absorbed attention."""
    quantized, _ = quantized_models[name]
    model = build(quantized).core.runner.model
    held = quant_weights(model)
    assert held and all(isinstance(w, QuantWeight) for w in held.values())
    assert not set(held) & {n for n, _ in model.named_parameters()}
    stored = 0
    for shard in quantized.glob("*.safetensors"):
        for k, t in load_file(str(shard)).items():
            codes = t.dtype in (torch.float8_e4m3fn, torch.int32, torch.uint8) and not k.endswith("weight_zero_point")
            if (codes or k.endswith(("weight_scale", "weight_scale_inv"))) and "kv_b_proj" not in k:
                stored += t.numel() * t.element_size()
    resident = sum(w.nbytes for w in held.values())
    assert abs(resident - stored) <= 0.05 * stored, (resident, stored)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3-fp8", "kimi_k25-int4", "qwen3_moe-int4-asym", "minimax_m2-fp8"])
def test_tp2_equals_tp1(name: str, quantized_models) -> None:
    """Each rank reads its slices of the codes and the scales (splits fall on block and group boundaries);
    experts split whole."""
    quantized, _ = quantized_models[name]
    assert_tp2_equals_tp1(quantized, [{"prompt": p, "params": greedy(10 + i)} for i, p in enumerate(PROMPTS)])


def test_spilled_blocks_of_a_quantized_model_reload_and_are_reused(quantized_models, tmp_path: Path) -> None:
    quantized, _ = quantized_models["deepseek_v3-fp8"]
    prompt = "Tell me the whole story of the sea and the stars, from the start. " * 30
    expected = build(quantized, max_model_len=2048).generate([{"prompt": prompt, "params": greedy(10)}])[0]
    tier = dict(max_model_len=2048, num_kv_blocks=16, prefill_chunk_tokens=64, host_kv_blocks=300,
                host_kv_dir=str(tmp_path / "host"))
    spilling = build(quantized, **tier)
    assert spilling.generate([{"prompt": prompt, "params": greedy(10)}])[0].output_token_ids == expected.output_token_ids
    assert spilling.kv.spills.peak > 8
    again = build(quantized, **tier).generate([{"prompt": prompt, "params": greedy(10)}])[0]
    assert again.output_token_ids == expected.output_token_ids and again.num_cached_tokens > 1000


@pytest.mark.parametrize("name", NAMES)
def test_ops_plans_the_tensors_a_quantized_load_reads(name: str, quantized_models, tmp_path: Path) -> None:
    """Quantized modules claim their codes and scales in ops' plan exactly as they do in the load."""
    quantized, _ = quantized_models[name]
    report = tmp_path / "ops.json"
    assert main(["ops", "--model", str(quantized), "--json", str(report)]) == 0
    weights = json.loads(report.read_text())["weights"]
    assert weights["unclaimed"] == [] and weights["reads"] == load_language_model(quantized)[1].tensors_read > 0


def test_ops_names_each_modules_format_and_kernel(quantized_models, tmp_path: Path) -> None:
    quantized, _ = quantized_models["kimi_k25-int4"]
    report = tmp_path / "ops.json"
    assert main(["ops", "--model", str(quantized), "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["missing"] == [] and result["weights"]["unclaimed"] == []
    lines = [c for c in result["components"] if c["name"].strip() in ("weight format", "stored")]
    assert lines[0]["need"] == "compressed-tensors: int4-group32-sym"
    stored = {c["need"].split(" in ")[0]: c for c in lines[1:]}
    assert set(stored) == {f"model.layers.*.mlp.experts.*.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    assert all("quant_linear" in c["impl"] for c in stored.values())


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "SHA256SUMS").unlink()
    return dst


def test_a_scale_no_component_claims_is_refused_by_ops_and_the_loader(quantized_models, tmp_path: Path,
                                                                      capsys) -> None:
    """A dense layer with a ``weight_scale_inv`` beside it, in an FP8 checkpoint: an FP8 block scale nothing
    reads would leave the e4m3 codes meaningless. ops fails naming it; generate refuses in one line."""
    copy = _copy(quantized_models["llama-fp8-channel"][0], tmp_path / "stray")
    stray = copy / "model-00003-of-00003.safetensors"
    tensors = load_file(str(stray))
    tensors["model.layers.0.mlp.down_proj.weight_zero_point"] = torch.zeros(64, 1, dtype=torch.int32)
    save_file(tensors, str(stray), metadata={"format": "pt"})
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.down_proj.weight_zero_point"] = stray.name
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    report = tmp_path / "ops.json"
    assert main(["ops", "--model", str(copy), "--json", str(report)]) == 1
    assert json.loads(report.read_text())["weights"]["unclaimed"] == ["model.layers.0.mlp.down_proj.weight_zero_point"]
    capsys.readouterr()
    assert main(["generate", "--model", str(copy), "--prompt", "hi", "--max-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.layers.0.mlp.down_proj.weight_zero_point" in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("quant, named", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method 'awq' is not implemented"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [16, 16]}, "fp8 fmt 'e5m2'"),
])
def test_an_unknown_quantization_is_refused_before_any_weight_is_read(quant: dict, named: str, quantized_models,
                                                                      tmp_path: Path, capsys) -> None:
    copy = _copy(quantized_models["deepseek_v3-fp8"][0], tmp_path / "unknown")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    for shard in copy.glob("*.safetensors"):
        shard.write_bytes(b"")  # reading any weight would fail differently
    assert main(["generate", "--model", str(copy), "--prompt", "hi", "--max-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err


@pytest.mark.slow
def test_a_tp_split_that_cuts_a_block_is_refused_naming_the_tensor(quantized_models, tmp_path: Path) -> None:
    """Blocks of 32: the dense layer's 96 intermediate columns split in two at column 48, inside a block. Each
    rank would read a scale that half belongs to the other: refused before any rank starts, naming the tensor,
    by the engine and by `strata serve` alike."""
    from strata.pipeline.parallel.shard_plan import ShardingError
    from strata.checkpoints.quantized_checkpoint import quantize_checkpoint

    dense = quantized_models["deepseek_v3-fp8"][0].parent / "deepseek_v3-fp8-dense"
    coarse = quantize_checkpoint(dense, tmp_path / "blocks32", "fp8-block", block=32)
    with pytest.raises(ShardingError, match=r"tensor layers\.0\.mlp\.down_proj\.weight: a tensor-parallel split "
                                            r"at column 48 cuts a 32-wide quantization block"):
        build(coarse, tp=2)
    assert main(["serve", str(coarse), "--config", _tp2_config(tmp_path)]) == 2  # refused before Ray starts


def _tp2_config(tmp_path: Path) -> str:
    path = tmp_path / "tp2.json"
    path.write_text(json.dumps({"mode": "aggregated", "stages": {"llm": {"tp": 2}}}))
    return str(path)


def test_plan_sizes_a_quantized_checkpoint_at_its_stored_bytes(quantized_models) -> None:
    """`strata plan` reads the quantization_config with the rest of config.json: the FP8 checkpoint's linears
    at a byte and a block scale each (its embeddings, LM head, routers and kv_b_proj in the dtype)."""
    from strata.planning.memory_plan import plan_memory

    quantized, reference = quantized_models["deepseek_v3-fp8"]
    fp8 = plan_memory(quantized, 1024, 1, 1 << 30, dtype="float32")
    dense = plan_memory(reference, 1024, 1, 1 << 30, dtype="float32")
    assert fp8.num_params == dense.num_params and fp8.weights_bytes < 0.8 * dense.weights_bytes
    assert fp8.weight_formats == ("attention, dense mlp, shared experts, experts in fp8-e4m3-block16x16; "
                                  "the rest in float32")

"""The Day-0 toolkit: `strata ops` names exactly what a checkpoint needs that we lack, `strata align`
passes where our numerics hold and names the first layer where they do not, `strata smoke` passes
on the demo model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.cli import main
from strata.checkpoints.tiny_model import ARCHITECTURES


def _strata(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _ops(capsys, model: Path, tmp_path: Path) -> tuple[int, dict]:
    report = tmp_path / "ops.json"
    code, _, err = _strata(capsys, "ops", "--model", str(model), "--json", str(report))
    assert "Traceback" not in err
    return code, json.loads(report.read_text())


# ------------------------------------------------------------------ ops
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_ops_covers_every_builtin_architecture(arch: str, tiny_models, tmp_path: Path, capsys) -> None:
    code, report = _ops(capsys, tiny_models[arch], tmp_path)
    assert code == 0 and report["missing"] == []
    names = {c["name"] for c in report["components"]}
    assert {"attention", "rope", "norm", "activation", "mlp", "vision_tower", "projector", "lm_head", "dtype"} <= names
    mlp = next(c for c in report["components"] if c["name"] == "mlp")
    assert ("MoE" in mlp["need"]) == (arch == "llava-mixtral")
    assert report["weights"]["unclaimed"] == [] and report["weights"]["missing"] == {}


def _config_dir(tmp_path: Path, name: str, config: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


LLAVA_TEXT = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 1000, "hidden_act": "silu"}
VISION = {"model_type": "clip_vision_model", "hidden_size": 32, "num_hidden_layers": 2, "image_size": 32, "patch_size": 8}

HAND_WRITTEN = {
    "unknown-rope-scaling": (
        {"model_type": "llava", "text_config": {**LLAVA_TEXT, "rope_scaling": {"rope_type": "longrope-v9", "factor": 4}},
         "vision_config": VISION},
        {"rope"}),
    "qwen2-vl": (
        {"model_type": "qwen2_vl", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 1000, "hidden_act": "silu",
         "rms_norm_eps": 1e-6, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
         "vision_config": {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32, "patch_size": 14}},
        {"architecture", "decoder", "rope", "vision_tower", "projector"}),
    "deepseek-v2": (  # a family the registry does not hold: the transformers fallback runs its layers, but MLA's
        # keys and values are not the paged cache's K/V heads
        {"model_type": "deepseek_v2", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 1000, "hidden_act": "silu",
         "rms_norm_eps": 1e-6, "kv_lora_rank": 16, "q_lora_rank": 24, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "n_shared_experts": 1, "n_group": 2, "topk_method": "group_limited_greedy",
         "rope_scaling": {"type": "yarn", "factor": 40}},
        {"attention"}),
    "llama-with-a-latent": (  # a registered family asked for a component it is not declared with
        {**LLAVA_TEXT, "architectures": ["LlamaForCausalLM"], "kv_lora_rank": 16, "qk_rope_head_dim": 8},
        {"attention"}),
    "text-model-with-a-vision-config": (
        {**LLAVA_TEXT, "architectures": ["LlamaForCausalLM"], "vision_config": VISION},
        {"vision_tower"}),
    "intern-vit-tower": (
        {"model_type": "llava", "text_config": LLAVA_TEXT, "vision_config": {**VISION, "model_type": "intern_vit_6b"}},
        {"vision_tower"}),
}


@pytest.mark.parametrize("case", HAND_WRITTEN, ids=list(HAND_WRITTEN))
def test_ops_names_exactly_what_is_missing(case: str, tmp_path: Path, capsys) -> None:
    config, expected = HAND_WRITTEN[case]
    code, report = _ops(capsys, _config_dir(tmp_path, case, config), tmp_path)
    assert code == 1
    assert set(report["missing"]) == expected
    assert {c["name"] for c in report["components"] if c["impl"] is None} == expected


def test_ops_reports_unclaimed_and_missing_tensors(llama_dir: Path, tmp_path: Path, capsys) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(llama_dir, copy)
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    final_norm = next(k for k in index["weight_map"] if k.endswith("language_model.model.norm.weight")
                      or k.endswith("language_model.norm.weight"))
    del index["weight_map"][final_norm]
    index["weight_map"]["model.mtp_head.weight"] = "model-00001-of-00004.safetensors"
    index_path.write_text(json.dumps(index))
    code, report = _ops(capsys, copy, tmp_path)
    assert code == 1
    assert report["weights"]["unclaimed"] == ["model.mtp_head.weight"]
    assert report["weights"]["missing"] == {"text": ["norm.weight"]}
    assert set(report["missing"]) == {"text weights", "unclaimed weights"}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_ops_plans_exactly_the_tensors_the_loader_reads(arch: str, tiny_models, tmp_path: Path, capsys) -> None:
    """ops prints the loader's own plan: the tensors it says a load reads are the ones the stages' loads read."""
    from strata.pipeline.models.model_config import load_model_config
    from strata.pipeline.models.model_loader import load_image_encoder, load_language_model

    model = tiny_models[arch]
    _, report = _ops(capsys, model, tmp_path)
    read = load_language_model(model)[1].tensors_read
    if load_model_config(model).takes_images:
        read += load_image_encoder(model)[1].tensors_read
    assert report["weights"]["reads"] == read > 0


def test_a_tensor_ops_calls_unclaimed_is_one_the_loader_refuses(llama_dir: Path, tmp_path: Path, capsys) -> None:
    """gpt-oss's attention sinks in a LLaVA checkpoint map to a decoder layer but no parameter owns them:
    ops says so, and the loader refuses the checkpoint rather than run without them."""
    from strata.pipeline.models.model_loader import load_language_model
    from strata.pipeline.models.weights import WeightsError

    copy = tmp_path / "copy"
    shutil.copytree(llama_dir, copy)
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    layer0 = next(k for k in index["weight_map"] if ".layers.0.self_attn.q_proj.weight" in k)
    sinks = layer0.replace("q_proj.weight", "sinks")
    save_file({sinks: torch.zeros(4)}, str(copy / "sinks.safetensors"))
    index["weight_map"][sinks] = "sinks.safetensors"
    index_path.write_text(json.dumps(index))
    code, report = _ops(capsys, copy, tmp_path)
    assert code == 1 and report["weights"]["unclaimed"] == [sinks] and "unclaimed weights" in report["missing"]
    with pytest.raises(WeightsError, match="owned by no parameter"):
        load_language_model(copy)


@pytest.mark.parametrize("damage", ["garbled-index", "unknown-architecture"])
def test_weights_ops_cannot_plan_are_reported_not_a_traceback(damage: str, llama_dir: Path, tmp_path: Path,
                                                              capsys) -> None:
    """A garbled index, or a config no model builds from: ops says why in one line and exits 1."""
    copy = tmp_path / "copy"
    shutil.copytree(llama_dir, copy)
    if damage == "garbled-index":
        (copy / "model.safetensors.index.json").write_text("{not json")
    else:
        config = json.loads((copy / "config.json").read_text())
        config.update(architectures=["NoSuchModelForCausalLM"], model_type="no_such_model")
        (copy / "config.json").write_text(json.dumps(config))
    report = tmp_path / "ops.json"
    code, out, err = _strata(capsys, "ops", "--model", str(copy), "--json", str(report))
    assert code == 1 and "Traceback" not in err
    if damage == "garbled-index":
        assert "is not a valid safetensors index" in out and "readable weights" in json.loads(report.read_text())["missing"]
    else:
        weights = json.loads(report.read_text())["weights"]
        assert "# weights: not planned" in out and weights["unclaimed"] and len(weights["unclaimed"]) == weights["tensors"]


def test_ops_on_a_directory_without_a_config_is_one_line(tmp_path: Path, capsys) -> None:
    code, out, err = _strata(capsys, "ops", "--model", str(tmp_path))
    assert code == 2 and err.startswith("strata: error: no config.json") and "Traceback" not in err


# ------------------------------------------------------------------ align
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_align_passes_on_every_builtin_architecture(arch: str, tiny_models, tmp_path: Path, capsys) -> None:
    report = tmp_path / "align.json"
    code, out, _ = _strata(capsys, "align", "--model", str(tiny_models[arch]), "--json", str(report))
    result = json.loads(report.read_text())
    assert code == 0, out
    points = [p["point"] for p in result["points"]]
    assert points[0].startswith("vision.") and "projector" in points and points[-2:] == ["final_norm", "logits"]
    assert sum(p.startswith("decoder.") for p in points) >= 2
    assert result["first_failure"] is None and result["points"][-1]["top1"] == 1.0


def test_align_in_bf16_on_the_reference_backend(llama_dir: Path, capsys) -> None:
    code, out, _ = _strata(capsys, "align", "--model", str(llama_dir), "--dtype", "bfloat16", "--backend", "torch")
    assert code == 0, out
    assert "PASS" in out


def test_align_names_the_one_layer_whose_weights_were_perturbed(llama_dir: Path, tmp_path: Path, capsys) -> None:
    reference = tmp_path / "reference.safetensors"
    code, out, _ = _strata(capsys, "align", "--model", str(llama_dir), "--save-reference", str(reference))
    assert code == 0 and reference.is_file(), out
    copy = tmp_path / "perturbed"
    shutil.copytree(llama_dir, copy)
    (copy / "SHA256SUMS").unlink()  # the copy's weights change on purpose
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(k for k in index if "layers.1.mlp.down_proj.weight" in k and "language_model" in k)
    shard = copy / index[name]
    tensors = load_file(str(shard))
    torch.manual_seed(0)
    tensors[name] = tensors[name] + 0.05 * torch.randn_like(tensors[name])
    save_file(tensors, str(shard), metadata={"format": "pt"})

    report = tmp_path / "align.json"
    code, out, _ = _strata(capsys, "align", "--model", str(copy), "--reference", str(reference), "--json", str(report))
    result = json.loads(report.read_text())
    assert code == 1
    assert result["first_failure"] == "decoder.1"
    assert "first divergence at decoder.1" in out
    passed = {p["point"]: p["pass"] for p in result["points"]}
    assert passed["decoder.0"] and passed["projector"]  # everything before the layer still agrees
    # and the untouched checkpoint still matches its own saved reference
    assert _strata(capsys, "align", "--model", str(llama_dir), "--reference", str(reference))[0] == 0


def test_align_refuses_a_file_that_is_not_a_reference(llama_dir: Path, tmp_path: Path, capsys) -> None:
    bogus = tmp_path / "bogus.safetensors"
    save_file({"x": torch.zeros(2)}, str(bogus))
    code, _, err = _strata(capsys, "align", "--model", str(llama_dir), "--reference", str(bogus))
    assert code == 2 and "not a reference saved by" in err


# ------------------------------------------------------------------ smoke
@pytest.mark.slow  # starts its own server and Ray cluster
def test_smoke_passes_on_the_demo_model(llama_dir: Path, capsys) -> None:
    code, out, _ = _strata(capsys, "smoke", "--model", str(llama_dir))
    assert code == 0, out
    for check in ("text: greedy text equals the engine's", "image, streamed: equals the engine's",
                  "a malformed request gets a 400", "a client disconnect frees its blocks", "/metrics shows the traffic"):
        assert f"{check}" in out and "FAIL" not in out
    assert "first token" in out and "tokens/s" in out


def test_ops_and_plan_never_compile_kernels(llama_dir: Path, tmp_path: Path) -> None:
    """They read configs: with an empty kernel cache, neither builds the CPU library (an engine does, once)."""
    from helpers import run_strata

    cache = tmp_path / "kernels"
    env = {"STRATA_KERNEL_CACHE": str(cache)}
    ops = run_strata("ops", "--model", str(llama_dir), env=env)
    assert ops.returncode == 0 and "compiled on first use" in ops.stdout, ops.stdout + ops.stderr
    plan = run_strata("plan", "--model", str(llama_dir), "--context", "8K", env=env)
    assert plan.returncode == 0, plan.stderr
    assert not list(cache.rglob("*.so")) and "compiling" not in ops.stderr + plan.stderr

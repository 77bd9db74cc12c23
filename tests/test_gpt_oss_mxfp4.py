"""gpt-oss as released: its experts in MXFP4 ``_blocks``/``_scales`` (codes from compressed-tensors, laid out by
``strata.checkpoints.gpt_oss_mxfp4``), read back by transformers' own dequantizer as the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_tp2_equals_tp1, build, greedy, transformers_greedy
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Mxfp4Config

from strata.checkpoints.gpt_oss_mxfp4 import write_gpt_oss_mxfp4
from strata.kernels.quant_weight import MXFP4Weight
from strata.pipeline.models.quant_modules import QuantExperts
from strata.pipeline.models.weights import WeightsError

PROMPTS = ["What is the capital of France? The quick brown fox jumps over the lazy dog.",
           "Tell me about the tides and the moon. " * 4, "A short one."]


@pytest.fixture(scope="module")
def mxfp4_model(text_models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gpt_oss_mxfp4(text_models["gpt_oss"], tmp_path_factory.mktemp("gpt-oss-mxfp4"))


def test_mxfp4_experts_stay_quantized_and_equal_transformers_dequantized(mxfp4_model: Path) -> None:
    engine = build(mxfp4_model, attention_backend="cpu", prefill_chunk_tokens=8)
    experts = engine.core.runner.model.layers[0].mlp.experts
    assert isinstance(experts, QuantExperts) and isinstance(experts.gate_up_proj, MXFP4Weight)
    weights = experts.gate_up_proj.rows * experts.gate_up_proj.cols * experts.num_experts
    assert experts.gate_up_proj.nbytes == weights * (0.5 + 1 / 32)  # 4.25 bits a weight, nothing expanded
    outs = engine.generate([{"prompt": p, "params": greedy(10, ignore_eos=True)} for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs):
        assert out.output_token_ids == transformers_greedy(mxfp4_model, prompt, 10, quantization_config=Mxfp4Config(dequantize=True)), prompt


@pytest.mark.slow
def test_mxfp4_experts_split_over_two_ranks_equal_one(mxfp4_model: Path) -> None:
    """Each rank reads its run of experts out of the stacked blocks and scales."""
    assert_tp2_equals_tp1(mxfp4_model, [{"prompt": p, "params": greedy(8)} for p in PROMPTS])


def _rewrite(model_dir: Path, out: Path, drop: str | None = None, config: dict | None = None) -> Path:
    """A copy of the checkpoint with one tensor dropped or config.json replaced (manifest left out)."""
    out.mkdir()
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(model_dir / shard), framework="pt") as f:
            save_file({k: f.get_tensor(k) for k in f.keys() if k != drop}, str(out / shard))
    index["weight_map"].pop(drop, None)
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("model.safetensors.index.json", "SHA256SUMS"):
            (out / f.name).write_bytes(f.read_bytes())
    if config is not None:
        (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_missing_scale_tensor_is_a_load_error(mxfp4_model: Path, tmp_path: Path) -> None:
    broken = _rewrite(mxfp4_model, tmp_path / "m", drop="model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises(WeightsError, match=r"lacks the quantized tensors .*layers\.1\.mlp\.experts"):
        build(broken)


def test_blocks_without_a_quantization_config_are_refused(mxfp4_model: Path, tmp_path: Path) -> None:
    config = json.loads((mxfp4_model / "config.json").read_text())
    config.pop("quantization_config")
    broken = _rewrite(mxfp4_model, tmp_path / "m", config=config)
    with pytest.raises(WeightsError, match=r"_(blocks|scales) is claimed by no component"):
        build(broken)

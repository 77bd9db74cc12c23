"""The streaming loader: both name layouts, SHA-256 manifest, stage-partial loads."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import write_transformers5_checkpoint
from strata.pipeline.models.model_config import load_model_config
from strata.pipeline.models.model_loader import load_image_encoder, load_language_model
from strata.pipeline.models.weights import WeightsError, canonical_name, weight_map


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _rename_vision_classic(src: Path, dst: Path) -> None:
    """The classic llava-hf layout: vision_tower.vision_model.*"""
    from safetensors import safe_open

    shutil.copytree(src, dst)
    (dst / "SHA256SUMS").unlink()
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    new_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(src / shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        renamed = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
        save_file(renamed, str(dst / shard))
        new_map.update({k: shard for k in renamed})
    index["weight_map"] = new_map
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("arch", ["llava-mixtral", "llava-qwen2"])
def test_name_layouts_give_identical_weights(arch: str, tiny_models, tmp_path: Path) -> None:
    src = tiny_models[arch]
    t5 = tmp_path / "t5"
    classic = tmp_path / "classic"
    write_transformers5_checkpoint(src, t5)
    _rename_vision_classic(src, classic)
    assert any(k.startswith("model.language_model.") for k in weight_map(t5))
    assert any(k.startswith("vision_tower.vision_model.") for k in weight_map(classic))
    ref_lm, ref_vis = _state(load_language_model(src)[0]), _state(load_image_encoder(src)[0])
    for other in (t5, classic):
        lm, vis = _state(load_language_model(other)[0]), _state(load_image_encoder(other)[0])
        assert lm.keys() == ref_lm.keys() and vis.keys() == ref_vis.keys()
        for k in ref_lm:
            assert torch.equal(lm[k], ref_lm[k]), k
        for k in ref_vis:
            assert torch.equal(vis[k], ref_vis[k]), k


def test_corrupted_shard_is_named_in_the_error(llama_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    shard = sorted(bad.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=shard.name):
        load_language_model(bad)


def test_truncated_shard_without_manifest_is_a_clear_error(llama_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "trunc"
    shutil.copytree(llama_dir, bad)
    (bad / "SHA256SUMS").unlink()
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(WeightsError, match=shard.name):
        load_language_model(bad)


def _with_extra_tensors(llama_dir: Path, dst: Path, names: list[str]) -> Path:
    """The checkpoint plus a shard holding ``names`` (listed in its index)."""
    shutil.copytree(llama_dir, dst)
    save_file({n: torch.zeros(4) for n in names}, str(dst / "extra.safetensors"))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"].update({n: "extra.safetensors" for n in names})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _layer_name(llama_dir: Path, layer: int, leaf: str) -> str:
    """``leaf`` of a decoder layer under this checkpoint's own prefix (classic or transformers-5 names)."""
    q = next(k for k in weight_map(llama_dir) if k.endswith(".layers.0.self_attn.q_proj.weight"))
    return q.replace(".layers.0.self_attn.q_proj.weight", f".layers.{layer}.{leaf}")


def test_a_decoder_tensor_no_parameter_owns_is_refused_not_dropped(llama_dir: Path, tmp_path: Path) -> None:
    """gpt-oss's attention sinks in a Llama checkpoint: skipping them would run another model."""
    sinks = _layer_name(llama_dir, 0, "self_attn.sinks")
    bad = _with_extra_tensors(llama_dir, tmp_path / "bad", [sinks])
    with pytest.raises(WeightsError, match=re.escape(sinks) + " of a decoder layer is owned by no parameter of this "
                                           "LlavaForConditionalGeneration model"):
        load_language_model(bad)


def test_a_tensor_no_name_rule_maps_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    bad = _with_extra_tensors(llama_dir, tmp_path / "bad", ["model.mtp_head.weight"])
    with pytest.raises(WeightsError, match=r"model\.mtp_head\.weight matches no name rule"):
        load_language_model(bad)


def test_rotary_tables_and_layers_past_the_decoder_are_skipped(llama_dir: Path, tmp_path: Path) -> None:
    """A stored rotary table is recomputed, and a layer past num_hidden_layers (DeepSeek's multi-token
    prediction) is not served: both load, and the model's weights are the checkpoint's."""
    layers = load_model_config(llama_dir).text.num_layers
    fine = _with_extra_tensors(llama_dir, tmp_path / "fine", [
        _layer_name(llama_dir, 0, "self_attn.rotary_emb.inv_freq"), _layer_name(llama_dir, layers, "self_attn.q_proj.weight")])
    got, want = _state(load_language_model(fine)[0]), _state(load_language_model(llama_dir)[0])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_stage_partial_load_reads_only_its_tensors(llama_dir: Path) -> None:
    mapping = weight_map(llama_dir)
    parts = {name: (canonical_name(name) or ("other", ""))[0] for name in mapping}
    _, vision_stats = load_image_encoder(llama_dir)
    _, text_stats = load_language_model(llama_dir)
    n_text = sum(1 for p in parts.values() if p == "text")
    assert text_stats.tensors_read == n_text
    # the vision stage reads vision + projector tensors only, and not the layers after the feature layer
    n_vision = sum(1 for p in parts.values() if p in ("vision", "projector"))
    assert 0 < vision_stats.tensors_read < n_vision
    text_only_shards = {s for n, s in mapping.items() if parts[n] == "text"} - {
        s for n, s in mapping.items() if parts[n] != "text"
    }
    assert text_only_shards, "the tiny checkpoint should have shards holding decoder tensors only"
    assert not text_only_shards & set(vision_stats.shards_opened)


@pytest.mark.parametrize("shard", ["../../../../etc/passwd", "/etc/passwd", "sub/../../outside.safetensors", ".."])
def test_an_index_cannot_point_outside_the_model_directory(shard: str, llama_dir: Path, tmp_path: Path,
                                                           capsys) -> None:
    """A hostile index naming ``../../../../etc/passwd`` made the loader open it. Now the weight map is
    refused before any file is opened, and the CLI says so in one line (exit 2)."""
    from strata.cli import main

    model = tmp_path / "hostile"
    shutil.copytree(llama_dir, model)
    (model / "SHA256SUMS").unlink()
    index = json.loads((model / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="outside the model directory|invalid shard"):
        weight_map(model)
    code = main(["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "outside the model directory" in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err


def test_a_shard_in_a_subdirectory_and_a_symlinked_shard_are_fine(llama_dir: Path, tmp_path: Path) -> None:
    """What real checkpoints do stays allowed: shards in a subfolder, and symlinks inside the directory
    (the Hugging Face cache links every snapshot file into blobs/)."""
    model = tmp_path / "nested"
    shutil.copytree(llama_dir, model)
    (model / "SHA256SUMS").unlink()
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    (model / "parts").mkdir()
    shutil.move(str(model / shards[0]), blobs / "abc123")
    (model / "parts" / shards[0]).symlink_to(blobs / "abc123")
    index["weight_map"] = {k: (f"parts/{v}" if v == shards[0] else v) for k, v in index["weight_map"].items()}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    text, _ = load_language_model(model)
    ref, _ = load_language_model(llama_dir)
    assert all(torch.equal(a, b) for a, b in zip(_state(text).values(), _state(ref).values()))

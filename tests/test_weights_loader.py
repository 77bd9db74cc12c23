"""The streaming loader: both name layouts, SHA-256 manifest, stage-partial loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import write_transformers5_checkpoint
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

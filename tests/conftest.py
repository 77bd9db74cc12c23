"""Shared fixtures: tiny checkpoints of every architecture, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from pipeline.tiny_model import ARCHITECTURES, TinyModelSpec, build_tiny_model, make_demo_image  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(TinyModelSpec(arch=arch), root / arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def llama_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llava-llama"]


@pytest.fixture(scope="session")
def demo_images(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """Two different deterministic images (PNG bytes)."""
    root = tmp_path_factory.mktemp("images")
    first = make_demo_image(root / "a.png", 64).read_bytes()
    from PIL import Image, ImageOps

    second_path = root / "b.png"
    ImageOps.mirror(Image.open(root / "a.png").convert("RGB")).rotate(90).save(second_path)
    return [first, second_path.read_bytes()]

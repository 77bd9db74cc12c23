"""The one catalog of tiny checkpoints (``strata make-tiny-model --arch NAME``, the demo, the tests): each name
and the builder that writes it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

from strata.checkpoints.tiny_model import ARCHITECTURES as LLAVA_ARCHITECTURES
from strata.checkpoints.tiny_model import TinyModelSpec, build_tiny_model
from strata.checkpoints.tiny_text_models import TEXT_ARCHITECTURES, build_tiny_text_model


def _kimi_k25(out: Path, seed: int) -> Path:
    from strata.checkpoints.tiny_kimi import build_tiny_kimi_k25

    return build_tiny_kimi_k25(out, seed=seed)


def _llava_onevision(out: Path, seed: int) -> Path:
    from strata.checkpoints.tiny_llava_onevision import build_tiny_llava_onevision

    return build_tiny_llava_onevision(out, seed=seed)


def _qwen_vl(version: str, moe: bool = False) -> Callable[[Path, int], Path]:
    def build(out: Path, seed: int) -> Path:
        from strata.checkpoints.tiny_qwen_vl import build_tiny_qwen2_5_vl, build_tiny_qwen3_vl

        return build_tiny_qwen2_5_vl(out, seed=seed) if version == "2.5" else build_tiny_qwen3_vl(out, seed=seed, moe=moe)

    return build


# native-resolution and anyres VLMs: their family's tiny config (the shape flags are LLaVA's)
VLM_BUILDERS: dict[str, Callable[[Path, int], Path]] = {
    "kimi_k25": _kimi_k25, "qwen2_5_vl": _qwen_vl("2.5"), "qwen3_vl": _qwen_vl("3"),
    "qwen3_vl_moe": _qwen_vl("3", moe=True), "llava_onevision": _llava_onevision,
}
TINY_ARCHITECTURES = LLAVA_ARCHITECTURES + TEXT_ARCHITECTURES + tuple(VLM_BUILDERS)


def build_tiny(arch: str, out: str | Path, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write the tiny checkpoint ``arch`` to ``out``. ``spec`` shapes a LLaVA (the others keep their family's
    tiny config); an unknown name is a ValueError listing the known ones."""
    out = Path(out)
    if arch in LLAVA_ARCHITECTURES:
        return build_tiny_model(replace(spec or TinyModelSpec(), arch=arch, seed=seed), out)
    if arch in TEXT_ARCHITECTURES:
        return build_tiny_text_model(arch, out, seed=seed)
    if arch in VLM_BUILDERS:
        return VLM_BUILDERS[arch](out, seed)
    raise ValueError(f"unknown tiny architecture {arch!r}; known: {', '.join(TINY_ARCHITECTURES)}")

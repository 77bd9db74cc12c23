"""The Preprocess stage's worker for a checkpoint, chosen by how its images become tokens."""

from __future__ import annotations

from pathlib import Path

from strata.pipeline.models.model_config import ModelConfig
from strata.stages.anyres_preprocessor import AnyresPreprocessor
from strata.stages.native_preprocessor import NativeResolutionPreprocessor
from strata.stages.pixel_budget import PixelBudget
from strata.stages.preprocessor import Preprocessor

ImagePreprocessor = Preprocessor | NativeResolutionPreprocessor | AnyresPreprocessor


def image_preprocessor(model_dir: str | Path, model_config: ModelConfig, max_pixels: int = 4096 * 4096,
                       pixel_budget: PixelBudget | None = None) -> ImagePreprocessor:
    """Native resolution (Kimi-K2.5, Qwen-VL: the checkpoint's processor, a grid per image), anyres tiles
    (LLaVA-OneVision), or fixed-size (CLIP: resize and crop, reproduced bit for bit)."""
    if model_config.native_resolution:
        return NativeResolutionPreprocessor(model_dir, max_pixels, pixel_budget, model_config.vision)
    if model_config.anyres:
        return AnyresPreprocessor(model_dir, model_config, max_pixels, pixel_budget)
    return Preprocessor.from_model_dir(model_dir, max_pixels=max_pixels, pixel_budget=pixel_budget)

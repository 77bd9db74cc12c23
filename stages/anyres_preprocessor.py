"""LLaVA-OneVision's image preprocessing: the checkpoint's own transformers image processor (resize to the
best grid resolution, pad, cut into tiles of the tower's size after a base view of the whole image),
behind the guards every image passes here (header checks before decoding, the pixel cap, the pixel
budget). The result carries the tiles, the image's size and its token count (``models.anyres``), which
intake expands the placeholder to.

Every image is tiled, however many a request holds: what transformers' processor does for a list of
images, and vLLM too (the original code's multi-image mode, base views only, is not applied).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from strata.pipeline.models.anyres import anyres_grid
from strata.pipeline.models.model_config import ModelConfig
from strata.stages.native_preprocessor import CheckpointImageProcessor
from strata.stages.pixel_budget import PixelBudget
from strata.stages.preprocessor import ImageCost, ImageError, PreprocessedImage, _open


class AnyresPreprocessor(CheckpointImageProcessor):
    def __init__(self, model_dir: str | Path, model_config: ModelConfig, max_pixels: int = 4096 * 4096,
                 pixel_budget: PixelBudget | None = None) -> None:
        super().__init__(model_dir, max_pixels, pixel_budget)
        self.grid = anyres_grid(model_config)
        pinpoints = tuple(tuple(int(v) for v in p) for p in getattr(self.processor, "image_grid_pinpoints", None) or ())
        if pinpoints != self.grid.pinpoints:
            raise ValueError("the image processor's image_grid_pinpoints differ from config.json's: token counts "
                             "would not match the model's features")

    def cost(self, image_bytes: bytes, mm_processor_kwargs: dict[str, Any] | None = None) -> ImageCost:
        """Tokens and pixels (base view and tiles) of one image from its header alone."""
        if mm_processor_kwargs:
            raise ImageError(f"mm_processor_kwargs: this model's image processor takes none, got {sorted(mm_processor_kwargs)}")
        width, height = _open(image_bytes, self.max_pixels).size
        rows, cols = self.grid.tiles(height, width)
        return ImageCost(self.grid.token_count(height, width), max(width * height, (1 + rows * cols) * self.grid.tile ** 2))

    def process(self, image_bytes: bytes, deadline: float | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None) -> PreprocessedImage:
        """Base view and tiles [1 + tiles, 3, S, S], the image's size and token count; ImageError for
        unusable input (and for mm_processor_kwargs: the tiling is the checkpoint's)."""
        cost = self.cost(image_bytes, mm_processor_kwargs)
        out = self.run_processor(image_bytes, deadline, cost.pixels)
        h, w = (int(v) for v in out["image_sizes"][0].tolist())
        rows, cols = self.grid.tiles(h, w)
        tiles = out["pixel_values"][0][: 1 + rows * cols]  # a batch pads to its largest image's tile count
        pixels = np.ascontiguousarray(tiles.numpy().astype(np.float32, copy=False))
        return PreprocessedImage(pixel_values=pixels, content_hash=hashlib.blake2b(image_bytes, digest_size=16).digest(),
                                 num_tokens=self.grid.token_count(h, w), image_size=(h, w))

"""Native-resolution image preprocessing (Kimi-K2.5): the checkpoint's own transformers image processor
behind the guards every image passes here.

The processor (``AutoImageProcessor`` from the checkpoint: navit resize within ``max_patches`` and the
per-side limit, pad to the merge grid, normalise, cut into flattened patches) defines how many tokens
an image becomes, so it is used as it is rather than re-implemented; this stage adds what serving needs
around it: the header is checked before any pixel is decoded (size cap, format), decoded pixels are
reserved in the replica's pixel budget, and the result carries the patch grid and token count the
intake expands the image's placeholder to.
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from strata.stages.pixel_budget import PixelBudget
from strata.stages.preprocessor import ImageError, PreprocessedImage, Preprocessor, _load, _open, _to_chw_uint8


class NativeResolutionPreprocessor:
    def __init__(self, model_dir: str | Path, max_pixels: int = 4096 * 4096,
                 pixel_budget: PixelBudget | None = None) -> None:
        from transformers import AutoImageProcessor

        if max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {max_pixels}")
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        self.group = int(getattr(self.processor, "merge_size", 2)) ** 2
        self.max_pixels = max_pixels
        self.pixel_budget = pixel_budget

    def process(self, image_bytes: bytes, deadline: float | None = None) -> PreprocessedImage:
        """Patches, grid and token count of one image; raises ImageError for unusable input."""
        content_hash = hashlib.blake2b(image_bytes, digest_size=16).digest()
        header = _open(image_bytes, self.max_pixels)
        width, height = header.size
        reserve = nullcontext() if self.pixel_budget is None else self.pixel_budget.hold(width * height, deadline)
        with reserve:
            image = _to_chw_uint8(_load(header), True)
            del header
            try:
                out = self.processor(images=[image], return_tensors="pt")
            except Exception as exc:  # the processor's own refusals (degenerate sizes) are the user's to fix
                raise ImageError(f"image of {width}x{height} cannot be processed for this model") from exc
            del image
            grid = tuple(int(v) for v in out["image_grid_thw"][0].tolist())
            pixels = np.ascontiguousarray(out["pixel_values"].numpy().astype(np.float32, copy=False))
        return PreprocessedImage(pixel_values=pixels, content_hash=content_hash, grid_thw=grid,  # type: ignore[arg-type]
                                 num_tokens=grid[0] * grid[1] * grid[2] // self.group)


def image_preprocessor(model_dir: str | Path, native_resolution: bool, max_pixels: int = 4096 * 4096,
                       pixel_budget: PixelBudget | None = None) -> "Preprocessor | NativeResolutionPreprocessor":
    """The Preprocess stage's worker for this checkpoint: native resolution (Kimi-K2.5) or fixed-size (CLIP)."""
    if native_resolution:
        return NativeResolutionPreprocessor(model_dir, max_pixels, pixel_budget)
    return Preprocessor.from_model_dir(model_dir, max_pixels=max_pixels, pixel_budget=pixel_budget)

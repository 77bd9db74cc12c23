"""Native-resolution image preprocessing (Kimi-K2.5, Qwen2.5-VL): the checkpoint's own transformers image
processor behind the guards every image passes here.

The processor (``AutoImageProcessor`` from the checkpoint: navit resize within ``max_patches`` and the
per-side limit, pad to the merge grid, normalise, cut into flattened patches) defines how many tokens
an image becomes, so it is used as it is rather than re-implemented; this stage adds what serving needs
around it: the header is checked before any pixel is decoded (size cap, format), decoded pixels are
reserved in the replica's pixel budget, and the result carries the patch grid and token count the
intake expands the image's placeholder to.

A request may choose its images' resolution within the processor's pixel range, as vLLM's
``mm_processor_kwargs`` (``min_pixels``/``max_pixels``, Qwen-VL's processor) does. One image at two
resolutions is two different inputs to the model, so the content hash that keys the encoder cache and the
KV prefix covers the grid the image was resized to, not only its bytes.
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from strata.stages.pixel_budget import PixelBudget
from strata.stages.preprocessor import ImageCost, ImageError, PreprocessedImage, _load, _open, _to_chw_uint8


class CheckpointImageProcessor:
    """The checkpoint's transformers image processor behind the guards: the header is read (size cap, format)
    before any pixel is decoded, and the decoded pixels are held in the pixel budget until processed."""

    def __init__(self, model_dir: str | Path, max_pixels: int = 4096 * 4096,
                 pixel_budget: PixelBudget | None = None) -> None:
        from transformers import AutoImageProcessor

        if max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {max_pixels}")
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True)
        self.max_pixels = max_pixels
        self.pixel_budget = pixel_budget

    def run_processor(self, image_bytes: bytes, deadline: float | None, pixels: int = 0, **kwargs: Any) -> Any:
        """The processor's output for one image (``kwargs`` go to the call); ImageError for unusable input.
        ``pixels``: what the processor will hold for it beyond the decoded image (its :class:`ImageCost`),
        reserved in the pixel budget with it."""
        header = _open(image_bytes, self.max_pixels)
        width, height = header.size
        hold = max(width * height, pixels)
        reserve = nullcontext() if self.pixel_budget is None else self.pixel_budget.hold(hold, deadline)
        with reserve:  # the full-size image is dropped before the reservation is given back
            image = _to_chw_uint8(_load(header), True)
            del header
            try:
                return self.processor(images=[image], return_tensors="pt", **kwargs)
            except Exception as exc:  # the processor's own refusals (degenerate sizes) are the user's to fix
                raise ImageError(f"image of {width}x{height} cannot be processed for this model") from exc
            finally:
                del image


def check_processor(processor: Any, vision: Any) -> None:
    """The processor cuts images into the patches the tower's weights take: its patch size, frames per
    patch and merge size agree with the vision config (a ``temporal_patch_size: 0`` would otherwise be a
    shape error on every image). ModelConfigError naming the field, at start."""
    from strata.pipeline.models.config_errors import ModelConfigError

    merge = getattr(vision, "spatial_merge_size", None) or (vision.merge_kernel[0] if hasattr(vision, "merge_kernel") else None)
    for key, want in (("patch_size", vision.patch_size), ("temporal_patch_size", getattr(vision, "temporal_patch_size", None)),
                      ("merge_size", merge)):
        got = getattr(processor, key, None)
        if want is not None and got is not None and got != want:
            raise ModelConfigError(f"the image processor's {key} is {got!r}, but the vision tower takes {want} "
                                   "(processor_config.json / preprocessor_config.json against config.json)")


class NativeResolutionPreprocessor(CheckpointImageProcessor):
    def __init__(self, model_dir: str | Path, max_pixels: int = 4096 * 4096,
                 pixel_budget: PixelBudget | None = None, vision: Any = None) -> None:
        """``vision``: the model's vision config, which the processor's patch geometry must match."""
        super().__init__(model_dir, max_pixels, pixel_budget)
        if vision is not None:
            check_processor(self.processor, vision)
        merge = int(getattr(self.processor, "merge_size", 2))
        self.group = merge**2
        size = getattr(self.processor, "size", None)
        # Qwen-VL's processor resizes within [shortest_edge, longest_edge] pixels; a request may narrow or move
        # that range, never below one merged token nor past what this stage decodes
        self.pixel_range: tuple[int, int] | None = None
        if getattr(size, "shortest_edge", None) and getattr(size, "longest_edge", None):
            self.pixel_range = (int(size.shortest_edge), int(size.longest_edge))
            self.min_request_pixels = (int(getattr(self.processor, "patch_size", 14)) * merge) ** 2

    def resolution(self, kwargs: dict[str, Any] | None) -> dict[str, int] | None:
        """The processor's ``size`` for a request's ``mm_processor_kwargs`` (None: the checkpoint's own);
        raises ValueError naming the problem (an HTTP 400)."""
        if not kwargs:
            return None
        if self.pixel_range is None:
            raise ValueError(f"mm_processor_kwargs: this model's image processor takes none, got {sorted(kwargs)}")
        unknown = sorted(set(kwargs) - {"min_pixels", "max_pixels"})
        if unknown:
            raise ValueError(f"mm_processor_kwargs: unknown key(s) {unknown}; this model takes min_pixels and max_pixels")
        low, high = self.min_request_pixels, self.max_pixels
        for key, value in kwargs.items():
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"mm_processor_kwargs.{key} must be an integer in [{low}, {high}], got {value!r}")
        lo, hi = int(kwargs.get("min_pixels", self.pixel_range[0])), int(kwargs.get("max_pixels", self.pixel_range[1]))
        if lo > hi:
            raise ValueError(f"mm_processor_kwargs: min_pixels ({lo}) exceeds max_pixels ({hi})")
        return {"shortest_edge": lo, "longest_edge": hi}

    def _size(self, mm_processor_kwargs: dict[str, Any] | None) -> dict[str, int] | None:
        try:
            return self.resolution(mm_processor_kwargs)
        except ValueError as exc:
            raise ImageError(str(exc)) from None

    def cost(self, image_bytes: bytes, mm_processor_kwargs: dict[str, Any] | None = None) -> ImageCost:
        """Tokens and pixels of one image from its header and the processor's own arithmetic
        (``get_number_of_image_patches``, what vLLM asks it), before anything is decoded."""
        size = self._size(mm_processor_kwargs)
        width, height = _open(image_bytes, self.max_pixels).size
        kwargs = {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]} if size else {}
        patches = int(self.processor.get_number_of_image_patches(height, width, kwargs))
        patch = int(getattr(self.processor, "patch_size", 14))
        return ImageCost(patches // self.group, max(width * height, patches * patch * patch))

    def process(self, image_bytes: bytes, deadline: float | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None) -> PreprocessedImage:
        """Patches, grid and token count of one image; raises ImageError for unusable input or settings."""
        size = self._size(mm_processor_kwargs)
        cost = self.cost(image_bytes, mm_processor_kwargs)
        out = self.run_processor(image_bytes, deadline, cost.pixels, **({"size": size} if size else {}))
        grid = tuple(int(v) for v in out["image_grid_thw"][0].tolist())
        pixels = np.ascontiguousarray(out["pixel_values"].numpy().astype(np.float32, copy=False))
        content_hash = hashlib.blake2b(image_bytes + b"grid=%d,%d,%d" % grid, digest_size=16).digest()
        return PreprocessedImage(pixel_values=pixels, content_hash=content_hash, grid_thw=grid,  # type: ignore[arg-type]
                                 num_tokens=grid[0] * grid[1] * grid[2] // self.group)


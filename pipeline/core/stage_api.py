"""What the in-process engine needs from the image stages. ``stages/`` implements these; the engine
is written against them so that ``pipeline`` never imports the rooms above it."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class PreprocessedImageLike(Protocol):
    pixel_values: np.ndarray
    content_hash: bytes


class ImageCostLike(Protocol):
    num_tokens: int
    pixels: int


class PreprocessorLike(Protocol):
    def process(self, image_bytes: bytes, deadline: float | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None) -> PreprocessedImageLike: ...

    def cost(self, image_bytes: bytes, mm_processor_kwargs: dict[str, Any] | None = None) -> ImageCostLike:
        """Tokens and pixels an image will cost, from its header (the preprocessors whose counts vary)."""
        ...


class EncoderLike(Protocol):
    def encode(self, images: list[Any]) -> list[np.ndarray]: ...

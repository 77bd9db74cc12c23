"""What the in-process engine needs from the image stages. ``stages/`` implements these; the engine
is written against them so that ``pipeline`` never imports the rooms above it."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class PreprocessedImageLike(Protocol):
    pixel_values: np.ndarray
    content_hash: bytes


class PreprocessorLike(Protocol):
    def process(self, image_bytes: bytes, deadline: float | None = None,
                mm_processor_kwargs: dict[str, Any] | None = None) -> PreprocessedImageLike: ...


class EncoderLike(Protocol):
    def encode(self, images: list[Any]) -> list[np.ndarray]: ...

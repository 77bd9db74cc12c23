"""What the in-process engine needs from each stage. ``stages/`` implements these; the engine
is written against them so that ``pipeline`` never imports the rooms above it."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from strata.pipeline.contract.request import TokenEvent
from strata.pipeline.core.sequence import Sequence


class PreprocessedImageLike(Protocol):
    pixel_values: np.ndarray
    content_hash: bytes


class PreprocessorLike(Protocol):
    def process(self, image_bytes: bytes) -> PreprocessedImageLike: ...


class EncoderLike(Protocol):
    def encode(self, images: list[Any]) -> list[np.ndarray]: ...


class PrefillResultLike(Protocol):
    seq: Sequence
    event: TokenEvent
    kv_handle: bytes | None  # None when the first token already finished the request


class PrefillerLike(Protocol):
    def add(self, seq: Sequence) -> None: ...
    def step(self, budget: int | None = None) -> list[Any]: ...
    def abort(self, seq: Sequence) -> None: ...
    def has_work(self) -> bool: ...
    def set_admission_watermark(self, blocks: Callable[[], int]) -> None: ...
    @property
    def last_num_tokens(self) -> int: ...


class DecoderLike(Protocol):
    def admit(self, seq: Sequence, kv_handle: bytes, tail_kv: bytes = b"") -> None: ...
    def step(self, budget: int | None = None) -> list[TokenEvent]: ...
    def abort(self, seq: Sequence) -> None: ...
    def has_work(self) -> bool: ...
    @property
    def last_num_tokens(self) -> int: ...
    @property
    def num_running(self) -> int: ...

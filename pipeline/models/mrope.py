"""Where each token sits under M-RoPE (Qwen-VL): 3-D positions (temporal, height, width) from the images' grids.

A text token's three positions are equal. An image's tokens take its merged patch grid: the row on the
height axis and the column on the width axis, all offset by where the image starts; the text after an
image resumes at that start plus the image's longer side (in merged patches), not at start plus its
token count. So a prompt's positions run behind or ahead of its token indices by a shift that grows
image by image, and every generated token sits at its index plus the final shift (``delta``).

Positions are a function of the token indices and of each image's offset, token count and grid, all of
which every stage already holds (the grid travels with the image's embeddings), so nothing but the grid
crosses a process: a layout is rebuilt wherever a sequence lands, in O(images), and gives any chunk's
positions in O(chunk) — a million-token prompt never materialises a [3, N] table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np


@dataclass(frozen=True)
class ImagePlacement:
    offset: int  # first placeholder token
    start: int  # its position on every axis (the offset plus the shift of the images before it)
    rows: int  # merged patch rows and columns: the image's tokens, in raster order
    cols: int


class MRopeLayout:
    """The 3-D positions of one sequence, from its images' placeholder spans and patch grids."""

    def __init__(self, images: Iterable[tuple[int, int, tuple[int, int, int]]]) -> None:
        """``images``: (offset, token count, the processor's patch grid (frames, rows, columns)) per image.
        The merge (patches per side of one token) is what makes the grid's patches the token count."""
        self.images: list[ImagePlacement] = []
        ends: list[int] = []
        shifts, shift, last_end = [0], 0, 0
        for offset, length, (t, h, w) in sorted(images, key=lambda i: i[0]):
            merge = math.isqrt(h * w // max(length, 1))
            if t != 1 or length < 1 or merge < 1 or h % merge or w % merge or (h // merge) * (w // merge) != length:
                raise ValueError(f"an image of patch grid {(t, h, w)} cannot fill {length} placeholder tokens "
                                 "(one frame, square merges)")
            rows, cols = h // merge, w // merge
            if offset < last_end:
                raise ValueError("image placeholder spans overlap")
            self.images.append(ImagePlacement(offset, offset + shift, rows, cols))
            shift += max(rows, cols) - length
            ends.append(offset + length)
            shifts.append(shift)
            last_end = offset + length
        self._ends = np.asarray(ends, dtype=np.int64)
        self._shifts = np.asarray(shifts, dtype=np.int64)
        self.delta = shift  # a token past the last image sits at its index + delta on every axis
        self._last_end = last_end

    def positions(self, start: int, end: int) -> np.ndarray:
        """int64 [3, end - start]: the positions of tokens ``start .. end - 1`` (prompt or generated)."""
        if start >= self._last_end:  # decodes and the text after the last image: one shift for all
            return np.repeat(np.arange(start + self.delta, end + self.delta, dtype=np.int64)[None], 3, axis=0)
        idx = np.arange(start, end, dtype=np.int64)
        text = idx + self._shifts[np.searchsorted(self._ends, idx, side="right")]
        out = np.repeat(text[None], 3, axis=0)
        for img in self.images:
            lo, hi = max(start, img.offset), min(end, img.offset + img.rows * img.cols)
            if lo >= hi:
                continue
            local = np.arange(lo - img.offset, hi - img.offset, dtype=np.int64)
            cols = slice(lo - start, hi - start)
            out[0, cols] = img.start
            out[1, cols] = img.start + local // img.cols
            out[2, cols] = img.start + local % img.cols
        return out

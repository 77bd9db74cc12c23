"""LLaVA-OneVision's "anyres": an image as its base view plus tiles at the best grid resolution, unpadded.

The processor resizes the image to the grid resolution (from ``image_grid_pinpoints``) that keeps most of
its pixels while wasting the least, pads it to that resolution, and cuts it into tiles of the tower's
size; the base view (the whole image at the tower's size) comes first. Here the tower's features of the
tiles are laid back out as one grid, the padding rows or columns are cut away again, a grid larger than
``max_tiles`` tiles' worth of features is downsampled (bilinear), and each row ends with the learned
``image_newline``. So an image costs ``base + rows * (columns + 1)`` tokens, known from its size alone:
:func:`token_count` is what intake expands the placeholder to, :func:`pack` what the encoder emits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.pipeline.models.model_config import ModelConfig, VisionConfig

if TYPE_CHECKING:  # the counting half is torch-free: the planner and intake use it
    import torch


@dataclass(frozen=True)
class AnyresGrid:
    tile: int  # the tower's image size in pixels
    patches: int  # patches per tile side
    pinpoints: tuple[tuple[int, int], ...]  # (height, width) grid resolutions
    max_tiles: int  # anyres_max_N

    def best_resolution(self, height: int, width: int) -> tuple[int, int]:
        """The grid resolution keeping most of the image's pixels, then wasting the least (transformers' rule)."""
        best, most, waste = self.pinpoints[0], -1, math.inf
        for h, w in self.pinpoints:
            scale = min(w / width, h / height)
            effective = min(int(width * scale) * int(height * scale), width * height)
            wasted = h * w - effective
            if effective > most or (effective == most and wasted < waste):
                best, most, waste = (h, w), effective, wasted
        return best

    def tiles(self, height: int, width: int) -> tuple[int, int]:
        """Tile rows and columns of an image of ``height x width`` pixels (the base view not counted)."""
        h, w = self.best_resolution(height, width)
        return h // self.tile, w // self.tile

    def unpadded(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(rows, columns) of the tiles' feature grid once padding is cut, and (rows, columns) after the
        max_tiles downsampling."""
        tile_rows, tile_cols = self.tiles(height, width)
        rows, cols = self.patches * tile_rows, self.patches * tile_cols
        if width / height > cols / rows:
            padding = (rows - int(round(height * (cols / width), 7))) // 2
            rows -= 2 * padding
        else:
            padding = (cols - int(round(width * (rows / height), 7))) // 2
            cols -= 2 * padding
        ratio = math.sqrt(rows * cols / (self.max_tiles * self.patches**2))
        if ratio > 1.1:
            return rows, cols, int(rows // ratio), int(cols // ratio)
        return rows, cols, rows, cols

    def token_count(self, height: int, width: int) -> int:
        """Language-model tokens of an image of ``height x width`` pixels: base view, rows, a newline per row."""
        _, _, rows, cols = self.unpadded(height, width)
        return self.patches**2 + rows * (cols + 1)

    def max_tokens(self) -> int:
        """At most this many tokens per image (the planner's figure): the base view, at most 1.1^2 x max_tiles
        tiles' worth of features (past that they are downsampled) and a newline per feature row."""
        cap = int(1.1**2 * self.max_tiles * self.patches**2)
        return self.patches**2 + max(min((h // self.tile * self.patches) * (w // self.tile * self.patches), cap)
                                     + h // self.tile * self.patches for h, w in self.pinpoints)

    def pack(self, features: "torch.Tensor", height: int, width: int, newline: "torch.Tensor") -> "torch.Tensor":
        """Projected features [1 + tiles, patches^2, D] of one image -> its tokens [token_count, D]."""
        import torch
        import torch.nn.functional as F

        base, tiles = features[0], features[1:]
        tile_rows, tile_cols = self.tiles(height, width)
        n, d = self.patches, features.shape[-1]
        if tiles.shape[0] != tile_rows * tile_cols:
            raise ValueError(f"an image of {width}x{height} px needs {tile_rows * tile_cols} tiles, got {tiles.shape[0]}")
        grid = tiles.view(tile_rows, tile_cols, n, n, d).permute(4, 0, 2, 1, 3).reshape(d, tile_rows * n, tile_cols * n)
        rows, cols, out_rows, out_cols = self.unpadded(height, width)
        top, left = (grid.shape[1] - rows) // 2, (grid.shape[2] - cols) // 2
        grid = grid[:, top : top + rows, left : left + cols]
        if (out_rows, out_cols) != (rows, cols):
            grid = F.interpolate(grid[None], [out_rows, out_cols], mode="bilinear")[0]
        grid = torch.cat([grid, newline.to(grid.dtype)[:, None, None].expand(d, out_rows, 1)], dim=-1)
        return torch.cat([base, grid.flatten(1).T])


def anyres_grid(cfg: ModelConfig) -> AnyresGrid:
    """The tiling of a LLaVA-OneVision checkpoint."""
    vision = cfg.vision
    assert isinstance(vision, VisionConfig) and cfg.anyres
    return AnyresGrid(vision.image_size, vision.image_size // vision.patch_size, cfg.image_grid_pinpoints,
                      cfg.anyres_max_tiles)

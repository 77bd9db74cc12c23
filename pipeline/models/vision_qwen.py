"""The Qwen-VL native-resolution vision transformers: any image size, 2-D RoPE, a 2x2 patch merger.

An image arrives as the processor's flattened patches (channels x 2 frames x p x p each; a still image is
its own second frame) ordered 2x2 group by 2x2 group, and its grid ``(1, h, w)``. Patches are embedded by
one linear map (the checkpoint's Conv3d, whose stride equals its kernel). Rotary embeddings rotate half of
each head by the patch's row and half by its column. Images of different sizes run every linear layer in
one packed batch, and attention in batches of equal-size windows or images (``kernels.segment_attention``):
nothing is padded.

* **Qwen2.5-VL**: patches are reordered window by window: most blocks attend only within windows of
  ``window_size`` pixels (in merged-patch units, tiles in raster order, raster order inside each), the
  blocks in ``fullatt_block_indexes`` over the whole image. RMSNorm and SwiGLU blocks. The encoder puts
  the merged tokens back in raster order.
* **Qwen3-VL**: a learned square position grid, resampled bilinearly (corners aligned) to each image,
  is added to the patch embeddings; every block attends over the whole image; LayerNorm and GELU blocks.
  DeepStack: after each block of ``deepstack_visual_indexes`` the features go through a merger of their
  own (``deepstack_merger_list``); the decoder adds them to its first layers' outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import layer_norm, rms_norm, rotate_fp32, segment_attention
from strata.pipeline.models.activations import activation
from strata.pipeline.models.model_config import QwenVisionConfig
from strata.pipeline.models.projector import Qwen3PatchMerger

NORM_EPS = 1e-6


class Norm(nn.Module):
    """RMSNorm (Qwen2.5-VL) or LayerNorm with a bias (Qwen3-VL), eps 1e-6 in both."""

    def __init__(self, size: int, layer_norm_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if layer_norm_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            return layer_norm(x, self.weight, self.bias, NORM_EPS)
        return rms_norm(x, self.weight, NORM_EPS)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel,
                              bias=cfg.variant == "qwen3")

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, channels * frames * p * p] -> [N, hidden]: the convolution over one patch is a dot product."""
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class Attention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate_fp32(q, cos, sin), rotate_fp32(k, cos, sin)
        out = segment_attention(q, k, v, lengths, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))



class SwiGLU(nn.Module):
    """Qwen2.5-VL's block MLP: ``gate_proj``, ``up_proj``, ``down_proj``, with biases."""

    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    """Qwen3-VL's block MLP: ``linear_fc1``, the activation, ``linear_fc2``."""

    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        qwen3 = cfg.variant == "qwen3"
        self.norm1, self.norm2 = Norm(cfg.hidden_size, qwen3), Norm(cfg.hidden_size, qwen3)
        self.attn = Attention(cfg)
        self.mlp: nn.Module = GeluMLP(cfg) if qwen3 else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class QwenViT(nn.Module):
    """Checkpoint names: ``patch_embed.proj``, ``blocks.N.{norm1,norm2,attn.qkv,attn.proj,mlp.*}``; Qwen3-VL
    also ``pos_embed`` and ``deepstack_merger_list.N.*``."""

    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        if cfg.variant == "qwen3":
            self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
            self.deepstack_merger_list = nn.ModuleList(
                Qwen3PatchMerger(cfg.hidden_size, cfg.merge_group, cfg.out_hidden_size, postshuffle_norm=True)
                for _ in cfg.deepstack_visual_indexes)
        half = cfg.hidden_size // cfg.num_heads // 2  # half a head rotates by the row, half by the column
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half))

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """Patches [N, patch_dim] of the images in order -> (features [N, hidden], in window order for
        Qwen2.5-VL with the index that puts merged groups back in raster order (None: raster order already),
        and Qwen3-VL's DeepStack tokens [N / 4, text hidden] per level)."""
        m = self.cfg.spatial_merge_size
        for t, h, w in grids:
            if t != 1 or h % m or w % m:
                raise ValueError(f"an image grid must be one frame of rows and columns divisible by {m}, got {(t, h, w)}")
        x = self.patch_embed(patches)
        cos, sin = self._rope(grids)
        images = [h * w for _, h, w in grids]
        if self.cfg.variant == "qwen3":
            x = x + self._positions(grids).to(x.dtype)
        attend = [images] * len(self.blocks)
        raster: torch.Tensor | None = None
        if self.cfg.window_size:
            order, windows = window_order(grids, m, self.cfg.window_size // m // self.cfg.patch_size)
            unit = m * m
            patch_order = (order[:, None] * unit + torch.arange(unit)).flatten()  # groups of m*m patches move together
            x, cos, sin = x[patch_order.to(x.device)], cos[patch_order], sin[patch_order]
            attend = [images if i in self.cfg.fullatt_block_indexes else [n * unit for n in windows]
                      for i in range(len(self.blocks))]
            raster = torch.argsort(order)
        cos, sin = cos.to(x.device), sin.to(x.device)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, attend[i])
            if i in self.cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.cfg.deepstack_visual_indexes.index(i)](x))
        return x, raster, deepstack

    def _rope(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] in the processor's patch order: (row angles, column angles), twice."""
        rows, cols = _patch_coordinates(grids, self.cfg.spatial_merge_size)
        angles = (torch.stack([rows, cols], dim=-1)[..., None].float() * self.inv_freq).flatten(1)  # rows', columns'
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Qwen3-VL's learned grid resampled to each image (bilinear, corners aligned), in patch order."""
        side = int(self.cfg.num_position_embeddings**0.5)
        table = self.pos_embed.weight.float().T.reshape(1, -1, side, side)
        m = self.cfg.spatial_merge_size
        out = []
        for _, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [D, h, w]
            out.append(grid.reshape(-1, h // m, m, w // m, m).permute(1, 3, 2, 4, 0).reshape(h * w, -1))
        return torch.cat(out)


def _patch_coordinates(grids: list[tuple[int, int, int]], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every patch of the packed images, in the processor's order (2x2 group by group)."""
    rows, cols = [], []
    for _, h, w in grids:
        r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        rows.append(r.reshape(block).transpose(1, 2).flatten())
        cols.append(c.reshape(block).transpose(1, 2).flatten())
    return torch.cat(rows), torch.cat(cols)


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """The merged groups of packed images reordered window by window, and each window's group count.

    An image of ``rows x cols`` groups is cut into ``window x window`` tiles (the last row and column of
    tiles may be smaller), tiles in raster order, groups in raster order inside a tile."""
    order, lengths, base = [], [], 0
    for _, h, w in grids:
        rows, cols = h // merge, w // merge
        grid = torch.arange(rows * cols).view(rows, cols) + base
        for r in range(0, rows, window):
            for c in range(0, cols, window):
                tile = grid[r : r + window, c : c + window].flatten()
                order.append(tile)
                lengths.append(tile.numel())
        base += rows * cols
    return torch.cat(order), lengths

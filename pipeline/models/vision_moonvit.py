"""MoonViT, Kimi-K2.5's native-resolution vision tower: any image size, 2-D axial RoPE, 2x2 patch merge.

An image arrives as its flattened 14x14 patches in raster order and its grid ``(1, h, w)``. Each
patch is embedded by a convolution, gets the learned position table resampled (bicubic, as
``F.interpolate`` with ``align_corners=False``) to the image's ``h x w``, and the layers attend
bidirectionally within the image, with rotary embeddings over the patch's row and column (a head's
dims interleave column and row frequencies). After the final norm, each 2x2 block of patches
becomes one group of four that the projector turns into one language-model token, so an image of
``h x w`` patches costs ``h*w/4`` tokens. Images of different sizes share every linear layer in one
packed batch, and attention runs in batches of equal-size images (no padding to the largest).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import layer_norm, rotate_fp32, segment_attention
from strata.pipeline.models.model_config import MoonViTConfig
from strata.pipeline.models.vision import VisionMLP

NORM_EPS = 1e-5


class PatchEmbed(nn.Module):
    def __init__(self, cfg: MoonViTConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.pos_emb = PositionTable(cfg)


class PositionTable(nn.Module):
    def __init__(self, cfg: MoonViTConfig) -> None:
        super().__init__()
        self.position_embeddings = nn.Parameter(torch.empty(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size))

    def for_grid(self, h: int, w: int) -> torch.Tensor:
        """[h*w, D] in raster order: the table bicubically resampled to the image's patch grid."""
        table = self.position_embeddings.permute(2, 0, 1)[None].float()  # [1, D, H, W]
        if table.shape[-2:] != (h, w):
            table = F.interpolate(table, size=(h, w), mode="bicubic", align_corners=False)
        return table[0].flatten(1).T


class Attention(nn.Module):
    def __init__(self, cfg: MoonViTConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, d // cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        shape = (n, self.num_heads, self.head_dim)
        q, k = rotate_fp32(self.q_proj(x).view(shape), cos, sin), rotate_fp32(self.k_proj(x).view(shape), cos, sin)
        out = segment_attention(q, k, self.v_proj(x).view(shape), lengths, self.head_dim**-0.5)  # within each image
        return self.proj(out.reshape(n, -1))



class Layer(nn.Module):
    def __init__(self, cfg: MoonViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=NORM_EPS)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=NORM_EPS)
        self.attn = Attention(cfg)
        self.mlp = VisionMLP(cfg)  # fc1, activation, fc2: CLIP's block, the same names

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(layer_norm(x, self.norm1.weight, self.norm1.bias, NORM_EPS), cos, sin, lengths)
        return x + self.mlp(layer_norm(x, self.norm2.weight, self.norm2.bias, NORM_EPS))


class MoonViT(nn.Module):
    """Checkpoint names: ``patch_embed.*``, ``layers.N.*``, ``final_layernorm.*``."""

    def __init__(self, cfg: MoonViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=NORM_EPS)
        head_dim = cfg.hidden_size // cfg.num_heads
        half = head_dim // 2  # half the dims rotate by the row, half by the column
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half))

    _FUSED = re.compile(r"^layers\.(\d+)\.attn\.wqkv\.(weight|bias)$")

    def owners_of(self, name: str) -> tuple[str, ...] | None:
        """A released checkpoint's fused ``wqkv`` fills q_proj, k_proj and v_proj (see split_fused)."""
        m = self._FUSED.match(name)
        return tuple(f"layers.{m.group(1)}.attn.{p}_proj.{m.group(2)}" for p in "qkv") if m else None

    def split_fused(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """``wqkv`` -> q, k, v; the release pairs each q/k head's RoPE dims as (x0, x1), (x2, x3), ...,
        our rotation (like transformers') takes the two halves, so q and k rows are regrouped per head."""
        m = self._FUSED.match(name)
        if m is None:
            return None
        q, k, v = tensor.chunk(3, dim=0)
        heads = self.cfg.num_heads

        def halves(t: torch.Tensor) -> torch.Tensor:
            rows = t.shape[0]
            return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

        prefix, kind = f"layers.{m.group(1)}.attn.", m.group(2)
        return [(f"{prefix}q_proj.{kind}", halves(q)), (f"{prefix}k_proj.{kind}", halves(k)), (f"{prefix}v_proj.{kind}", v)]

    def rope(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim]: per head dim pair i, the column's then the row's angle at frequency i."""
        pos = torch.cat([torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 2)
                         for _, h, w in grids]).to(device)  # (row, col) in raster order
        freqs = pos[..., None].float() * self.inv_freq.to(device)  # [N, 2, F]
        angles = freqs.transpose(1, 2).flip(-1).flatten(1)  # [N, 2F]: (col, row) per frequency
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Flattened patches [N, 3, p, p] of the images in order -> per image [h*w/4, 4, D] (2x2 groups)."""
        for t, h, w in grids:
            if t != 1 or h % 2 or w % 2:
                raise ValueError(f"an image grid must be one frame of even height and width, got {(t, h, w)}")
        x = self.patch_embed.proj(patches.to(self.patch_embed.proj.weight.dtype)).flatten(1)
        x = x + torch.cat([self.patch_embed.pos_emb.for_grid(h, w) for _, h, w in grids]).to(x.dtype)
        cos, sin = self.rope(grids, x.device)
        lengths = [h * w for _, h, w in grids]
        for layer in self.layers:
            x = layer(x, cos, sin, lengths)
        x = layer_norm(x, self.final_layernorm.weight, self.final_layernorm.bias, NORM_EPS)
        out, start = [], 0
        for (_, h, w), n in zip(grids, lengths):
            grid = x[start : start + n].view(h // 2, 2, w // 2, 2, -1).permute(0, 2, 1, 3, 4)
            out.append(grid.reshape(h * w // 4, 4, -1))
            start += n
        return out

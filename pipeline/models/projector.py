"""Projectors from vision features to the language model's embedding space: LLaVA's two-layer MLP,
and the 2x2 patch mergers of the native-resolution towers (Kimi-K2.5, Qwen-VL)."""

from __future__ import annotations

import torch
from torch import nn

from strata.kernels import rms_norm
from strata.pipeline.models.activations import activation


class MultiModalProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class AnyresProjector(MultiModalProjector):
    """LLaVA-OneVision's projector: LLaVA's two linears, and the learned ``image_newline`` that ends each
    row of an image's tiled features (``models.anyres``)."""

    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__(in_features, hidden, act, bias)
        self.image_newline = nn.Parameter(torch.empty(hidden))


class PatchMergerProjector(nn.Module):
    """Kimi-K2.5's projector: each 2x2 group of vision features is normed, concatenated and mapped by a
    two-layer GELU MLP to one language-model token. Checkpoint names: ``pre_norm``, ``in_proj``, ``out_proj``."""

    def __init__(self, vision_hidden: int, group: int, text_hidden: int, eps: float) -> None:
        super().__init__()
        self.pre_norm = nn.LayerNorm(vision_hidden, eps=eps)
        self.in_proj = nn.Linear(vision_hidden * group, vision_hidden * group)
        self.out_proj = nn.Linear(vision_hidden * group, text_hidden)

    def forward(self, groups: torch.Tensor) -> torch.Tensor:
        """[N, group, vision_hidden] -> [N, text_hidden]."""
        x = self.pre_norm(groups).reshape(groups.shape[0], -1)
        return self.out_proj(torch.nn.functional.gelu(self.in_proj(x)))


class QwenPatchMerger(nn.Module):
    """Qwen2.5-VL's merger: RMSNorm of each patch, each 2x2 group concatenated, a two-layer GELU MLP to one
    language-model token. Checkpoint names: ``ln_q``, ``mlp.0``, ``mlp.2``."""

    def __init__(self, vision_hidden: int, group: int, text_hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.group_size = vision_hidden * group
        self.ln_q = nn.Module()
        self.ln_q.weight = nn.Parameter(torch.ones(vision_hidden))
        self.eps = eps
        self.mlp = nn.Sequential(nn.Linear(self.group_size, self.group_size), nn.GELU(),
                                 nn.Linear(self.group_size, text_hidden))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N * group, vision_hidden] (groups consecutive) -> [N, text_hidden]."""
        return self.mlp(rms_norm(patches, self.ln_q.weight, self.eps).view(-1, self.group_size))


class Qwen3PatchMerger(nn.Module):
    """Qwen3-VL's merger: LayerNorm of each patch (or, ``postshuffle_norm``, of each concatenated 2x2 group:
    DeepStack's mergers), a two-layer GELU MLP to one language-model token. Names: ``norm``,
    ``linear_fc1``, ``linear_fc2``."""

    def __init__(self, vision_hidden: int, group: int, text_hidden: int, postshuffle_norm: bool = False,
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.group_size = vision_hidden * group
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.group_size if postshuffle_norm else vision_hidden, eps=eps)
        self.linear_fc1 = nn.Linear(self.group_size, self.group_size)
        self.linear_fc2 = nn.Linear(self.group_size, text_hidden)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N * group, vision_hidden] (groups consecutive) -> [N, text_hidden]."""
        x = self.norm(patches.view(-1, self.group_size) if self.postshuffle_norm else patches)
        return self.linear_fc2(torch.nn.functional.gelu(self.linear_fc1(x.view(-1, self.group_size))))

"""LLaVA's two-layer MLP from vision features to the language model's embedding space."""

from __future__ import annotations

import torch
from torch import nn

from strata.pipeline.models.activations import activation


class MultiModalProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


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

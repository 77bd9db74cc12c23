"""CLIP and SigLIP vision towers, run only up to the deepest hidden state the LLaVA config selects.

SigLIP (LLaVA-OneVision) is CLIP's layer stack without the class token and the pre-norm, with a bias on
the patch embedding; its pooling head and final norm are not read (LLaVA reads a hidden state)."""

from __future__ import annotations

import torch
from torch import nn

from strata.kernels import dense_attention, layer_norm
from strata.pipeline.models.activations import activation
from strata.pipeline.models.model_config import MoonViTConfig, VisionConfig


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        if cfg.class_token:
            self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=not cfg.class_token
        )
        self.position_embedding = nn.Embedding(cfg.num_patches + cfg.class_token, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        if hasattr(self, "class_embedding"):
            patches = torch.cat([self.class_embedding.expand(pixel_values.shape[0], 1, -1), patches], dim=1)
        return patches + self.position_embedding.weight.unsqueeze(0)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = dense_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1))


class VisionMLP(nn.Module):
    """fc1, activation, fc2 (CLIP; MoonViT's layers use it too)."""

    def __init__(self, cfg: VisionConfig | MoonViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.eps = cfg.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(layer_norm(x, self.layer_norm1.weight, self.layer_norm1.bias, self.eps))
        return x + self.mlp(layer_norm(x, self.layer_norm2.weight, self.layer_norm2.bias, self.eps))


class VisionEncoderLayers(nn.Module):
    def __init__(self, cfg: VisionConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(num_layers))


class VisionTower(nn.Module):
    """CLIP vision transformer. ``num_layers`` may be fewer than the checkpoint has: LLaVA reads
    an intermediate hidden state, so the layers after it are neither loaded nor run."""

    def __init__(self, cfg: VisionConfig, num_layers: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = VisionEmbeddings(cfg)
        if cfg.class_token:  # CLIP's pre-norm (SigLIP has none)
            self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = VisionEncoderLayers(cfg, num_layers)

    def hidden_states(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """[embeddings (after CLIP's pre-norm), after layer 0, after layer 1, ...] like transformers' hidden_states."""
        x = self.embeddings(pixel_values)
        if hasattr(self, "pre_layrnorm"):
            x = layer_norm(x, self.pre_layrnorm.weight, self.pre_layrnorm.bias, self.cfg.layer_norm_eps)
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return states

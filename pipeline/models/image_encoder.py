"""Vision tower + projector: pixels in, language-model embeddings out (the encoder stage's model).

Two kinds, chosen by the registry: LLaVA's CLIP tower read at a selected layer and a two-layer MLP
(fixed-size images, a fixed token count each), and Kimi-K2.5's MoonViT with its 2x2 patch merger
(native resolution: each image its own patch grid and token count).
"""

from __future__ import annotations

import torch
from torch import nn

from strata.pipeline.models.model_config import ModelConfig, MoonViTConfig, VisionConfig
from strata.pipeline.models.projector import MultiModalProjector, PatchMergerProjector
from strata.pipeline.models.vision import VisionTower
from strata.pipeline.models.vision_moonvit import MoonViT


class ImageEncoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        vision = cfg.vision
        if isinstance(vision, MoonViTConfig):
            self.vision_tower: nn.Module = MoonViT(vision)
            self.projector: nn.Module = PatchMergerProjector(vision.hidden_size, vision.merge_group,
                                                             cfg.text.hidden_size, vision.projection_eps)
            return
        assert isinstance(vision, VisionConfig)
        self.vision_tower = VisionTower(vision, cfg.vision_layers_needed)
        in_features = vision.hidden_size * len(cfg.vision_feature_layers)
        self.projector = MultiModalProjector(in_features, cfg.text.hidden_size, cfg.projector_hidden_act, cfg.projector_bias)

    @property
    def native_resolution(self) -> bool:
        return isinstance(self.vision_tower, MoonViT)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Fixed-size images [N, 3, H, W] -> [N, num_image_tokens, text_hidden], selecting layers as the
        config says (CLIP)."""
        states = self.vision_tower.hidden_states(pixel_values)
        selected = [states[i] for i in self.cfg.vision_feature_layers]
        if self.cfg.vision_feature_select_strategy == "default":
            selected = [s[:, 1:] for s in selected]
        return self.projector(torch.cat(selected, dim=-1))

    @torch.inference_mode()
    def encode_native(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Native-resolution images as their flattened patches [sum of h*w, 3, p, p] and grids ->
        per image [h*w/4, text_hidden]. Every linear layer runs once over the packed batch."""
        groups = self.vision_tower(patches, grids)
        tokens = self.projector(torch.cat(groups))
        return list(torch.split(tokens, [g.shape[0] for g in groups]))

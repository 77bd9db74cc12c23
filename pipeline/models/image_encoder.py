"""Vision tower + projector: pixels in, language-model embeddings out (the encoder stage's model)."""

from __future__ import annotations

import torch
from torch import nn

from strata.pipeline.models.model_config import LlavaConfig
from strata.pipeline.models.projector import MultiModalProjector
from strata.pipeline.models.vision import VisionTower


class ImageEncoderModel(nn.Module):
    def __init__(self, cfg: LlavaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg.vision, cfg.vision_layers_needed)
        in_features = cfg.vision.hidden_size * len(cfg.vision_feature_layers)
        self.projector = MultiModalProjector(in_features, cfg.text.hidden_size, cfg.projector_hidden_act, cfg.projector_bias)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, num_image_tokens, text_hidden], selecting layers as the config says."""
        states = self.vision_tower.hidden_states(pixel_values)
        selected = [states[i] for i in self.cfg.vision_feature_layers]
        if self.cfg.vision_feature_select_strategy == "default":
            selected = [s[:, 1:] for s in selected]
        return self.projector(torch.cat(selected, dim=-1))

"""Vision tower + projector: pixels in, language-model embeddings out (the encoder stage's model).

Four kinds, chosen by the registry: LLaVA's CLIP tower read at a selected layer and a two-layer MLP
(fixed-size images, a fixed token count each); LLaVA-OneVision's SigLIP tower over an image's base view
and tiles, packed with unpadding and row newlines (``models.anyres``: a count per image size); and the
native-resolution towers with their 2x2 patch mergers, Kimi-K2.5's MoonViT and the Qwen-VL ViTs (each
image its own patch grid and token count).
"""

from __future__ import annotations

import torch
from torch import nn

from strata.pipeline.models.model_config import ModelConfig, MoonViTConfig, QwenVisionConfig, VisionConfig
from strata.pipeline.models.anyres import anyres_grid
from strata.pipeline.models.projector import (AnyresProjector, MultiModalProjector, PatchMergerProjector,
                                              Qwen3PatchMerger, QwenPatchMerger)
from strata.pipeline.models.vision import VisionTower
from strata.pipeline.models.vision_moonvit import MoonViT
from strata.pipeline.models.vision_qwen import QwenViT


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
        if isinstance(vision, QwenVisionConfig):
            self.vision_tower = QwenViT(vision)
            merger = Qwen3PatchMerger if vision.variant == "qwen3" else QwenPatchMerger
            self.projector = merger(vision.hidden_size, vision.merge_group, cfg.text.hidden_size)
            return
        assert isinstance(vision, VisionConfig)
        self.vision_tower = VisionTower(vision, cfg.vision_layers_needed)
        in_features = vision.hidden_size * len(cfg.vision_feature_layers)
        projector = AnyresProjector if cfg.anyres else MultiModalProjector
        self.projector = projector(in_features, cfg.text.hidden_size, cfg.projector_hidden_act, cfg.projector_bias)

    @property
    def native_resolution(self) -> bool:
        return isinstance(self.vision_tower, (MoonViT, QwenViT))

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Fixed-size images [N, 3, H, W] -> [N, num_image_tokens, text_hidden], selecting layers as the
        config says (CLIP)."""
        states = self.vision_tower.hidden_states(pixel_values)
        selected = [states[i] for i in self.cfg.vision_feature_layers]
        if self.cfg.vision_feature_select_strategy == "default":
            selected = [s[:, 1:] for s in selected]
        return self.projector(torch.cat(selected, dim=-1))

    @property
    def anyres(self) -> bool:
        return isinstance(self.projector, AnyresProjector)

    @torch.inference_mode()
    def encode_anyres(self, tiles: torch.Tensor, counts: list[int], sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """LLaVA-OneVision: every image's base view and tiles [sum of counts, 3, S, S] (one plain batch: all
        are the tower's size) and each image's (height, width) -> per image [its token count, text_hidden]."""
        grid = anyres_grid(self.cfg)
        features = self.forward(tiles)
        return [grid.pack(f, h, w, self.projector.image_newline)
                for f, (h, w) in zip(torch.split(features, counts), sizes)]

    @torch.inference_mode()
    def encode_native(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Native-resolution images as their flattened patches [sum of h*w, 3, p, p] and grids ->
        per image [h*w/4, text_hidden] (with DeepStack, Qwen3-VL: [1 + levels, h*w/4, text_hidden], the
        merger's tokens first). Every linear layer runs once over the packed batch."""
        if isinstance(self.vision_tower, QwenViT):
            features, raster, deepstack = self.vision_tower(patches, grids)
            tokens = self.projector(features)
            if raster is not None:  # Qwen2.5-VL's window order: merged, then put back in raster order
                tokens = tokens[raster.to(tokens.device)]
            if deepstack:
                tokens = torch.stack([tokens, *deepstack])
            sizes = [h * w // self.vision_tower.cfg.merge_group for _, h, w in grids]
            return list(torch.split(tokens, sizes, dim=-2))
        groups = self.vision_tower(patches, grids)
        tokens = self.projector(torch.cat(groups))
        return list(torch.split(tokens, [g.shape[0] for g in groups]))

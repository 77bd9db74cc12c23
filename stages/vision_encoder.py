"""Encoder stage: vision tower + projector, with a cache of encoded images by content hash."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.models.model_config import ModelConfig, load_model_config
from strata.pipeline.models.model_loader import load_image_encoder, resolve_dtype
from strata.stages.preprocessor import PreprocessedImage


class VisionEncoder:
    """Pixels -> language-model embeddings. The same image (same bytes) is never encoded twice
    while it is cached; the decoder weights are never loaded here."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, cfg: ModelConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model_config = cfg or load_model_config(model_dir)
        self.model, self.load_stats = load_image_encoder(
            model_dir, resolve_dtype(self.config.dtype), self.config.device, self.model_config
        )
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.cache_hits = 0
        self.cache_misses = 0

    def encode(self, images: list[PreprocessedImage]) -> list[np.ndarray]:
        """One [num_image_tokens, text_hidden] float32 array per image, in order."""
        missing = [img for img in dict((i.content_hash, i) for i in images).values() if img.content_hash not in self._cache]
        self.cache_hits += len(images) - len(missing)
        self.cache_misses += len(missing)
        fresh: dict[bytes, np.ndarray] = {}
        if missing and self.model.native_resolution:  # images of different sizes: packed, not padded
            if any(img.grid_thw is None for img in missing):
                raise ValueError("a native-resolution image arrived without its patch grid")
            for batch in patch_batches(missing, self.config.encoder_batch_patches):
                patches = torch.from_numpy(np.concatenate([img.pixel_values for img in batch])).to(self.config.device)
                feats = self.model.encode_native(patches, [img.grid_thw for img in batch])  # type: ignore[misc]
                fresh.update({img.content_hash: f.float().cpu().numpy() for img, f in zip(batch, feats)})
        elif missing and self.model.anyres:  # every image's base view and tiles: one batch of equal-size crops
            if any(img.image_size is None for img in missing):
                raise ValueError("an anyres image arrived without its size")
            tiles = torch.from_numpy(np.concatenate([img.pixel_values for img in missing])).to(self.config.device)
            feats = self.model.encode_anyres(tiles, [img.pixel_values.shape[0] for img in missing],
                                             [img.image_size for img in missing])  # type: ignore[misc]
            fresh = {img.content_hash: f.float().cpu().numpy() for img, f in zip(missing, feats)}
        elif missing:
            pixels = torch.from_numpy(np.stack([img.pixel_values for img in missing])).to(self.config.device)
            feats = self.model(pixels).float().cpu().numpy()
            fresh = {img.content_hash: f for img, f in zip(missing, feats)}
        out = [fresh[i.content_hash] if i.content_hash in fresh else self._cache[i.content_hash] for i in images]
        for key in [i.content_hash for i in images]:
            if key in fresh:
                self._remember(key, fresh[key])
            elif key in self._cache:
                self._cache.move_to_end(key)
        return out

    def _remember(self, key: bytes, features: np.ndarray) -> None:
        self._cache[key] = features
        while len(self._cache) > max(1, self.config.encoder_cache_size):
            self._cache.popitem(last=False)


def patch_batches(images: list[PreprocessedImage], budget: int) -> list[list[PreprocessedImage]]:
    """Consecutive images packed into calls of at most ``budget`` patches (0: one call); an image larger
    than the budget is a call of its own."""
    if budget <= 0:
        return [images]
    batches: list[list[PreprocessedImage]] = []
    size = 0
    for img in images:
        n = img.pixel_values.shape[0]
        if batches and size + n <= budget:
            batches[-1].append(img)
            size += n
        else:
            batches.append([img])
            size = n
    return batches

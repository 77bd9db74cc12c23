"""Own implementations of the LLaVA family: CLIP vision tower, projector, Llama-family decoder."""

from strata.pipeline.models.decoder import LanguageModel
from strata.pipeline.models.projector import MultiModalProjector
from strata.pipeline.models.vision import VisionTower

__all__ = ["LanguageModel", "MultiModalProjector", "VisionTower"]

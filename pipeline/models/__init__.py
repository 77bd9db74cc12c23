"""Own implementations of the LLaVA family: CLIP vision tower, projector, Llama-family decoder."""

from pipeline.models.decoder import LanguageModel
from pipeline.models.projector import MultiModalProjector
from pipeline.models.vision import VisionTower

__all__ = ["LanguageModel", "MultiModalProjector", "VisionTower"]

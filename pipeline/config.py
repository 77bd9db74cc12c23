"""Typed engine configuration shared by every stage."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class EngineConfig:
    """Knobs of the engine core. Defaults suit the tiny demo model on a CPU."""

    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"
    block_size: int = 16
    num_kv_blocks: int = 1024  # device-tier capacity in blocks
    max_num_batched_tokens: int = 2048  # per-step token budget (decodes first, then prefill chunks)
    prefill_chunk_tokens: int = 512  # largest prefill chunk of one sequence in one step
    max_num_seqs: int = 64  # running sequences per stage
    max_model_len: int = 4096  # prompt + output tokens of one request
    enable_prefix_caching: bool = True
    encoder_cache_size: int = 64  # images kept encoded, by content hash
    max_image_pixels: int = 4096 * 4096
    max_images_per_request: int = 8

    def validate(self) -> None:
        positive = ("block_size", "num_kv_blocks", "max_num_batched_tokens", "prefill_chunk_tokens", "max_num_seqs", "max_model_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence must be able to decode in one step
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown engine config keys: {', '.join(sorted(unknown))}")
        cfg = cls(**data)
        cfg.validate()
        return cfg

"""Test helpers shared by several test files (not fixtures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.config import EngineConfig
from pipeline.sampling_params import SamplingParams
from pipeline.scheduler import ScheduledChunk
from pipeline.sequence import Sequence


def build(model_dir: Path, **config: Any):
    from stages.factory import build_engine

    return build_engine(model_dir, EngineConfig(**config))


def greedy(max_tokens: int = 12, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def prefill_logits(engine: Any, prompt: str, images: list[bytes]) -> torch.Tensor:
    """Last-position logits of one prompt computed by our model runner in a single chunk."""
    text = engine.tokenizer.render_user_prompt(prompt, len(images))
    enc = engine.tokenizer.encode(text, len(images))
    embeds = engine._encode_images(images, enc.image_offsets)
    pool = engine.prefiller.pool
    seq = Sequence("probe", enc.token_ids, greedy(1), pool.layout.block_size, embeds)
    seq.block_table.block_ids = [pool.allocate() for _ in range(-(-len(enc.token_ids) // pool.layout.block_size))]
    try:
        return engine.prefiller.core.runner.execute([ScheduledChunk(seq, 0, seq.num_tokens)])[0]
    finally:
        for b in seq.block_table.block_ids:
            pool.free(b)

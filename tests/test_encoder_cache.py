"""The encoder stage's cache: the same image (same bytes) is encoded once while cached, the cache holds
at most ``encoder_cache_size`` images (least recently used out first), and hits return the same
embeddings a fresh encode would."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from strata.pipeline.contract.config import EngineConfig
from strata.stages.preprocessor import Preprocessor
from strata.stages.vision_encoder import VisionEncoder


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def parts(llama_dir: Path):
    return Preprocessor.from_model_dir(llama_dir), llama_dir


def test_hits_misses_and_identical_embeddings(parts) -> None:
    pre, model_dir = parts
    encoder = VisionEncoder(model_dir, EngineConfig(encoder_cache_size=2))
    a, b, c = (pre.process(_png(i)) for i in range(3))
    first = encoder.encode([a, b, a])  # a twice in one batch: encoded once
    assert (encoder.cache_hits, encoder.cache_misses) == (1, 2)
    assert np.array_equal(first[0], first[2]) and not np.array_equal(first[0], first[1])
    again = encoder.encode([a])
    assert (encoder.cache_hits, encoder.cache_misses) == (2, 2)
    assert np.array_equal(again[0], first[0])  # a hit returns exactly what the miss computed
    fresh = VisionEncoder(model_dir, EngineConfig()).encode([a])[0]
    np.testing.assert_allclose(again[0], fresh, rtol=1e-5, atol=1e-5)  # and a fresh encode agrees (batch size aside)


def test_the_cache_is_bounded_and_evicts_the_least_recently_used(parts) -> None:
    pre, model_dir = parts
    encoder = VisionEncoder(model_dir, EngineConfig(encoder_cache_size=2))
    a, b, c = (pre.process(_png(10 + i)) for i in range(3))
    encoder.encode([a])
    encoder.encode([b])
    encoder.encode([a])  # a is now the most recent
    encoder.encode([c])  # evicts b, not a
    assert len(encoder._cache) == 2
    misses = encoder.cache_misses
    encoder.encode([a])
    assert encoder.cache_misses == misses  # still cached
    encoder.encode([b])
    assert encoder.cache_misses == misses + 1  # was evicted

"""The four stage deployments: thin Ray Serve wrappers around ``stages/``.

Each replica builds its stage from the model directory and the engine config, serves plain
method calls through deployment handles, and reports its autoscaling signal. Values that
cross replicas are numpy arrays, bytes and builtins (zero-copy through the object store for
arrays; KV itself moves through the host tier, named by a ``KVHandle``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import numpy as np
from ray import serve

from deployments import metrics
from pipeline.config import EngineConfig
from stages.factory import build_decode_service, build_prefill_service
from stages.preprocessor import ImageError, PreprocessedImage, Preprocessor
from stages.vision_encoder import VisionEncoder


@serve.deployment(name="Preprocess")
class Preprocess:
    """Image bytes -> pixel values + content hash (decode, RGB, resize, crop, normalize)."""

    def __init__(self, model_dir: str, engine: dict[str, Any]) -> None:
        config = EngineConfig.from_dict(engine)
        self.preprocessor = Preprocessor.from_model_dir(model_dir, max_pixels=config.max_image_pixels)
        self.pending = 0

    async def process(self, data: bytes) -> dict[str, Any]:
        """``{"pixel_values", "hash"}``, or ``{"error"}`` for an image the user must fix (a 400)."""
        self.pending += 1
        t0 = time.perf_counter()
        try:
            image = await asyncio.to_thread(self.preprocessor.process, data)
            return {"pixel_values": image.pixel_values, "hash": image.content_hash}
        except ImageError as exc:
            return {"error": str(exc)}
        finally:
            self.pending -= 1
            metrics.processing_time().observe(time.perf_counter() - t0, tags={"stage": "preprocess"})

    def record_autoscaling_stats(self) -> dict[str, float]:
        metrics.queue_depth().set(float(self.pending), tags={"stage": "preprocess"})
        return {"pending_images": float(self.pending)}


@serve.deployment(name="Encode")
class Encode:
    """Pixel values -> image embeddings, with the encoder cache keyed by content hash."""

    def __init__(self, model_dir: str, engine: dict[str, Any]) -> None:
        self.encoder = VisionEncoder(model_dir, EngineConfig.from_dict(engine))
        self.pending = 0
        self.deltas = metrics.CounterDelta()
        self._lock = asyncio.Lock()  # one forward at a time; the cache is not thread-safe

    async def encode(self, images: list[dict[str, Any]]) -> list[np.ndarray]:
        batch = [PreprocessedImage(np.asarray(i["pixel_values"]), i["hash"]) for i in images]
        self.pending += len(batch)
        t0 = time.perf_counter()
        try:
            async with self._lock:
                return await asyncio.to_thread(self.encoder.encode, batch)
        finally:
            self.pending -= len(batch)
            metrics.processing_time().observe(time.perf_counter() - t0, tags={"stage": "encode"})
            self.deltas.inc(metrics.encoder_cache(), float(self.encoder.cache_hits), {"result": "hit"})
            self.deltas.inc(metrics.encoder_cache(), float(self.encoder.cache_misses), {"result": "miss"})

    def stats(self) -> dict[str, int]:
        return {"cache_hits": self.encoder.cache_hits, "cache_misses": self.encoder.cache_misses}

    def record_autoscaling_stats(self) -> dict[str, float]:
        metrics.queue_depth().set(float(self.pending), tags={"stage": "encode"})
        return {"pending_images": float(self.pending)}


@serve.deployment(name="Prefill")
class Prefill:
    """Chunked prefill with prefix reuse; returns the first token and a KVHandle."""

    def __init__(self, model_dir: str, engine: dict[str, Any]) -> None:
        self.service = build_prefill_service(model_dir, EngineConfig.from_dict(engine))
        self.deltas = metrics.CounterDelta()

    async def prefill(self, wire: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        result = await self.service.prefill(wire)
        metrics.processing_time().observe(time.perf_counter() - t0, tags={"stage": "prefill"})
        metrics.prefix_tokens().inc(float(wire["num_prompt_tokens"]), tags={"kind": "queried"})
        if result["num_cached_tokens"]:
            metrics.prefix_tokens().inc(float(result["num_cached_tokens"]), tags={"kind": "hit"})
        return result

    async def stats(self) -> dict[str, Any]:
        return await self.service.stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        stats = await self.service.stats()
        metrics.queue_depth().set(float(stats["queued_prompt_tokens"]), tags={"stage": "prefill"})
        metrics.record_kv("prefill", stats, self.deltas)
        return {"queued_prompt_tokens": float(stats["queued_prompt_tokens"])}

    def __del__(self) -> None:
        self.service.close()


@serve.deployment(name="Decode")
class Decode:
    """Continuous batching of every sequence admitted to this replica; streams token events."""

    def __init__(self, model_dir: str, engine: dict[str, Any]) -> None:
        self.service = build_decode_service(model_dir, EngineConfig.from_dict(engine))
        self.deltas = metrics.CounterDelta()

    async def generate(self, wire: dict[str, Any], handle: bytes) -> AsyncIterator[list[dict[str, Any]]]:
        async for batch in self.service.generate(wire, handle):
            yield batch

    async def stats(self) -> dict[str, Any]:
        return await self.service.stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        stats = await self.service.stats()
        metrics.queue_depth().set(float(stats["running"]), tags={"stage": "decode"})
        metrics.record_kv("decode", stats, self.deltas)
        return {"running_sequences": float(stats["running"]), "kv_occupancy": float(stats["kv_occupancy"])}

    def __del__(self) -> None:
        self.service.close()

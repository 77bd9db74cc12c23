"""The four stage deployments: thin Ray Serve wrappers around ``stages/``.

Each replica builds its stage from the model directory and the engine config, serves plain
method calls through deployment handles, and reports its autoscaling signal. Prefill and decode
speak the request contract as msgpack bytes (``Request`` in, ``Handoff`` out, token-event
batches streamed); images cross as numpy arrays (zero-copy through the object store); KV itself
moves through the host tier, named by a ``KVHandle``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

import numpy as np
import ray
from ray import serve

from strata.deployments.ray_serve import metrics
from strata.deployments.ray_serve.kv_blocks import block_fetcher, ensure_block_server
from strata.kernels.threads import apply_threads
from strata.deployments.ray_serve.tp_actors import RayWorkers, group_host
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.handoff import Handoff
from strata.pipeline.contract.request import Request, pack_events
from strata.pipeline.parallel.fault_points import stall_point
from strata.stages.factory import build_decode_service, build_prefill_service
from strata.stages.kv_transfer import KVPuller
from strata.stages.pixel_budget import PixelBudget
from strata.pipeline.models.model_config import load_model_config
from strata.stages.image_preprocessing import image_preprocessor
from strata.stages.preprocessor import ImageError, PreprocessedImage
from strata.stages.stage_loop import LoopStopped
from strata.stages.vision_encoder import VisionEncoder


@serve.deployment(name="Preprocess")
class Preprocess:
    """Image bytes -> pixel values + content hash (decode, RGB, resize, crop, normalize).

    Images decode on worker threads, as many at once as fit in the replica's pixel budget
    (``engine.max_image_pixels_in_flight``): the rest wait, in order and on their threads (never on
    the event loop), up to ``engine.image_wait_timeout_s`` from their arrival here."""

    def __init__(self, model_dir: str, engine: dict[str, Any]) -> None:
        config = EngineConfig.from_dict(engine)
        apply_threads(config.num_threads, config.tp)
        self.budget = PixelBudget(config.image_pixels_in_flight, config.image_wait_timeout_s)
        self.preprocessor = image_preprocessor(model_dir, load_model_config(model_dir), max_pixels=config.max_image_pixels,
                                               pixel_budget=self.budget)
        self.pending = 0

    async def ready(self) -> bool:
        """Answered once this replica is up (the ingress's /health asks every stage)."""
        return True

    async def process(self, data: bytes, mm_processor_kwargs: dict[str, Any] | None = None) -> PreprocessedImage | ImageError:
        """The preprocessed image, or the :class:`ImageError` that says what the user must fix (a 400);
        ``mm_processor_kwargs``: the request's processor settings (native resolution: its pixel range)."""
        self.pending += 1
        t0 = time.perf_counter()
        deadline = self.budget.deadline()  # from arrival: time queued for a worker thread counts too
        try:
            return await asyncio.to_thread(self._process, data, deadline, mm_processor_kwargs)
        except ImageError as exc:
            return exc.with_traceback(None)  # its frames would keep the decoded pixels alive
        finally:
            self.pending -= 1
            metrics.processing_time().observe(time.perf_counter() - t0, tags={"stage": "preprocess"})

    def _process(self, data: bytes, deadline: float | None, mm_processor_kwargs: dict[str, Any] | None) -> PreprocessedImage:
        stall_point("preprocess")
        return self.preprocessor.process(data, deadline, mm_processor_kwargs)

    def record_autoscaling_stats(self) -> dict[str, float]:
        metrics.queue_depth().set(float(self.pending), tags={"stage": "preprocess"})
        return {"pending_images": float(self.pending)}


@serve.deployment(name="Encode")
class Encode:
    """Pixel values -> image embeddings, with the encoder cache keyed by content hash."""

    def __init__(self, model_dir: str, engine: dict[str, Any]) -> None:
        config = EngineConfig.from_dict(engine)
        apply_threads(config.num_threads, config.tp)
        self.encoder = VisionEncoder(model_dir, config)
        self.pending = 0
        self.deltas = metrics.CounterDelta()
        self._lock = asyncio.Lock()  # one forward at a time; the cache is not thread-safe

    async def encode(self, batch: list[PreprocessedImage]) -> list[np.ndarray]:
        self.pending += len(batch)
        t0 = time.perf_counter()
        try:
            async with self._lock:
                return await asyncio.to_thread(self._encode, batch)
        finally:
            self.pending -= len(batch)
            metrics.processing_time().observe(time.perf_counter() - t0, tags={"stage": "encode"})
            self.deltas.inc(metrics.encoder_cache(), float(self.encoder.cache_hits), {"result": "hit"})
            self.deltas.inc(metrics.encoder_cache(), float(self.encoder.cache_misses), {"result": "miss"})

    def _encode(self, batch: list[PreprocessedImage]) -> list[np.ndarray]:
        stall_point("encode")
        return self.encoder.encode(batch)

    def stats(self) -> dict[str, int]:
        return {"cache_hits": self.encoder.cache_hits, "cache_misses": self.encoder.cache_misses}

    async def ready(self) -> bool:
        return True

    def record_autoscaling_stats(self) -> dict[str, float]:
        metrics.queue_depth().set(float(self.pending), tags={"stage": "encode"})
        return {"pending_images": float(self.pending)}


class LanguageReplica:
    """What a Prefill and a Decode replica share: the service that steps their (maybe tensor-parallel) stage."""

    service: Any

    async def stats(self) -> dict[str, Any]:
        return await self.service.stats()

    async def ready(self) -> bool:
        return True

    def check_health(self) -> None:
        """Serve replaces a replica whose tensor-parallel worker died (its group cannot step any more)."""
        if not self.service.healthy():
            raise RuntimeError("a tensor-parallel worker of this replica died")

    def __del__(self) -> None:
        self.service.close()


@serve.deployment(name="Prefill")
class Prefill(LanguageReplica):
    """Chunked prefill with prefix reuse; returns the first token and a KVHandle."""

    def __init__(self, model_dir: str, engine: dict[str, Any]) -> None:
        self.service = build_prefill_service(model_dir, EngineConfig.from_dict(engine), RayWorkers, group_host())
        self.deltas = metrics.CounterDelta()
        # this node's host tier is served to decode replicas on other nodes; hand-offs say where from
        self.node_id = ensure_block_server(self.service.prefiller.kv)

    async def prefill(self, request: bytes) -> tuple[bytes, bytes]:
        """A msgpack ``Request`` in; its first token event (a packed event batch) and its msgpack
        ``Handoff`` out. The ingress reads only the first: the hand-off goes on to decode untouched."""
        t0 = time.perf_counter()
        req = Request.from_msgpack(request)
        handoff = await self.service.prefill(req)
        handoff.source = self.node_id
        metrics.processing_time().observe(time.perf_counter() - t0, tags={"stage": "prefill"})
        metrics.prefix_tokens().inc(float(req.num_prompt_tokens), tags={"kind": "queried"})
        if handoff.num_cached_tokens:
            metrics.prefix_tokens().inc(float(handoff.num_cached_tokens), tags={"kind": "hit"})
        return pack_events([handoff.first]), handoff.to_msgpack()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        try:
            stats = await self.service.stats()
        except LoopStopped:  # the replica is shutting down: nothing is queued here any more
            return {"queued_prompt_tokens": 0.0}
        metrics.queue_depth().set(float(stats["queued_prompt_tokens"]), tags={"stage": "prefill"})
        metrics.record_kv("prefill", stats, self.deltas)
        return {"queued_prompt_tokens": float(stats["queued_prompt_tokens"])}


@serve.deployment(name="Decode")
class Decode(LanguageReplica):
    """Continuous batching of every sequence admitted to this replica; streams token events."""

    def __init__(self, model_dir: str, engine: dict[str, Any]) -> None:
        self.service = build_decode_service(model_dir, EngineConfig.from_dict(engine), RayWorkers, group_host())
        self.deltas = metrics.CounterDelta()
        kv = self.service.decoder.kv
        self.service.puller = KVPuller(kv, ray.get_runtime_context().get_node_id(), block_fetcher(kv.fingerprint),
                                       run_on_loop=self.service.loop.run)

    async def generate(self, handoff: bytes) -> AsyncIterator[bytes]:
        """A msgpack ``Handoff`` in; msgpack token-event batches out, one per wake-up."""
        async for batch in self.service.generate(Handoff.from_msgpack(handoff)):
            yield pack_events(batch)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        try:
            stats = await self.service.stats()
        except LoopStopped:  # the replica is shutting down: nothing runs here any more
            return {"running_sequences": 0.0, "kv_occupancy": 0.0}
        metrics.queue_depth().set(float(stats["running"]), tags={"stage": "decode"})
        metrics.record_kv("decode", stats, self.deltas)
        for result, count in stats["kv_transfer_blocks"].items():
            self.deltas.inc(metrics.kv_transfer_blocks(), float(count), {"result": result})
        return {"running_sequences": float(stats["running"]), "kv_occupancy": float(stats["kv_occupancy"])}

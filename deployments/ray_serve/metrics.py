"""Strata's metrics, exported through ``ray.util.metrics`` to Ray's Prometheus endpoint and the
Ray dashboard. Every name starts with ``strata_`` (Prometheus shows them as ``ray_strata_*``).

Created lazily, once per process, so importing this module costs nothing outside Ray. Importing it
installs the request metrics' exporters into the OpenAI surface (``openai.request_metrics``), which
records through them from then on.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from strata.deployments.openai import request_metrics

_LATENCY_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
_ITL_S = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0]


@lru_cache(maxsize=None)
def requests() -> Counter:
    return Counter("strata_requests", "Requests by endpoint and final status", tag_keys=("endpoint", "status"))


@lru_cache(maxsize=None)
def ttft() -> Histogram:
    return Histogram("strata_time_to_first_token_seconds", "Time to first token", _LATENCY_S, tag_keys=("endpoint",))


@lru_cache(maxsize=None)
def itl() -> Histogram:
    return Histogram("strata_inter_token_latency_seconds", "Gap between streamed tokens", _ITL_S, tag_keys=("endpoint",))


@lru_cache(maxsize=None)
def e2e() -> Histogram:
    return Histogram("strata_e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_S,
                     tag_keys=("endpoint",))


@lru_cache(maxsize=None)
def generation_tokens() -> Counter:
    return Counter("strata_generation_tokens", "Tokens generated (streamed to clients)", tag_keys=("endpoint",))


@lru_cache(maxsize=None)
def requests_in_engine() -> Gauge:
    return Gauge("strata_engine_requests", "Requests in a stage's engine: running (decoding) or waiting",
                 tag_keys=("stage", "state"))


@lru_cache(maxsize=None)
def kv_usage() -> Gauge:
    return Gauge("strata_kv_cache_usage", "Share of a stage's device KV blocks in use (0..1)", tag_keys=("stage",))


@lru_cache(maxsize=None)
def queue_depth() -> Gauge:
    return Gauge("strata_stage_queue_depth", "Work waiting in a stage (its autoscaling signal)", tag_keys=("stage",))


@lru_cache(maxsize=None)
def processing_time() -> Histogram:
    return Histogram("strata_stage_processing_seconds", "Time a stage spends on one call", _LATENCY_S,
                     tag_keys=("stage",))


@lru_cache(maxsize=None)
def kv_blocks() -> Gauge:
    return Gauge("strata_kv_blocks", "KV blocks per tier and state", tag_keys=("stage", "tier", "state"))


@lru_cache(maxsize=None)
def kv_transfer_blocks() -> Counter:
    return Counter("strata_kv_transfer_blocks", "KV blocks a decode replica pulled from another node's host tier "
                   "(fetched), refused as corrupt (rejected) or could not get (unavailable; both recomputed)",
                   tag_keys=("result",))


@lru_cache(maxsize=None)
def prefix_tokens() -> Counter:
    return Counter("strata_prefix_cache_tokens", "Prompt tokens looked up in / served from the prefix cache",
                   tag_keys=("kind",))


@lru_cache(maxsize=None)
def encoder_cache() -> Counter:
    return Counter("strata_encoder_cache", "Encoder cache lookups by result", tag_keys=("result",))


@lru_cache(maxsize=None)
def preemptions() -> Counter:
    return Counter("strata_preemptions", "Sequences preempted (recomputed) by a stage", tag_keys=("stage",))


@lru_cache(maxsize=None)
def spec_decode_tokens() -> Counter:
    return Counter("strata_spec_decode_tokens", "Speculative decoding: draft tokens proposed and accepted (acceptance "
                   "rate = accepted / drafted)", tag_keys=("stage", "kind"))


@lru_cache(maxsize=None)
def spec_decode_verifications() -> Counter:
    return Counter("strata_spec_decode_verifications", "Speculative decoding: sequence-steps that verified a draft "
                   "(tokens per such step = (accepted + verifications) / verifications)", tag_keys=("stage",))


@lru_cache(maxsize=None)
def autoscaling_target() -> Gauge:
    return Gauge("strata_autoscaling_target_replicas", "Replicas a stage's policy asks for", tag_keys=("stage",))


class CounterDelta:
    """Turn a stage's monotonic totals into Counter increments (records only what is new)."""

    def __init__(self) -> None:
        self._last: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def inc(self, counter: Counter, total: float, tags: dict[str, str]) -> None:
        key = (id(counter), tuple(sorted(tags.items())))
        with self._lock:
            first = key not in self._last
            delta = total - self._last.get(key, 0.0)
            self._last[key] = total
        if delta > 0:
            counter.inc(delta, tags=tags)
        elif first:  # export the series at 0 from the start, so a dashboard panel is never empty
            counter._record(0.0, tags=tags)  # Counter.inc refuses 0; recording it is what inc does


def record_kv(stage: str, kv_stats: dict[str, Any], deltas: CounterDelta) -> None:
    """KV gauges per tier, plus preemption totals, from a stage service's ``stats()``."""
    device = kv_stats["kv"]["device"]
    kv_usage().set(device["in_use"] / max(1, device["total"]), tags={"stage": stage})
    for state in ("running", "waiting"):
        if state in kv_stats:
            requests_in_engine().set(float(kv_stats[state]), tags={"stage": stage, "state": state})
    for state in ("in_use", "cached", "free"):
        kv_blocks().set(float(device[state]), tags={"stage": stage, "tier": "device", "state": state})
    for tier, t in kv_stats["kv"]["tiers"].items():
        kv_blocks().set(float(t["blocks"]), tags={"stage": stage, "tier": tier, "state": "stored"})
    kv_blocks().set(float(kv_stats["kv"]["spilled_blocks"]), tags={"stage": stage, "tier": "device", "state": "spilled"})
    deltas.inc(preemptions(), float(kv_stats["preemptions"]), {"stage": stage})
    spec = kv_stats.get("speculation")
    if spec is not None:  # a stage that decodes with speculative decoding on
        for kind in ("drafted", "accepted"):
            deltas.inc(spec_decode_tokens(), float(spec[kind]), {"stage": stage, "kind": kind})
        deltas.inc(spec_decode_verifications(), float(spec["verifications"]), {"stage": stage})


request_metrics.install({"requests": requests, "ttft": ttft, "itl": itl, "e2e": e2e, "prefix_tokens": prefix_tokens,
                         "generation_tokens": generation_tokens})

"""The request metrics the OpenAI surface records: requests by endpoint and final status, time to first
token, inter-token gaps, end-to-end latency, prompt tokens looked up in / served from the prefix cache, and
the tokens generated.

The surface imports no Ray, so it records through whatever is installed here: the Ray Serve room installs
its exporters (``ray_serve.metrics``, to Ray's Prometheus endpoint) as it is imported; the surface on its
own (in-process, no cluster) keeps them in this process, where a caller can read them.
"""

from __future__ import annotations

from typing import Callable, Protocol

NAMES = ("requests", "ttft", "itl", "e2e", "prefix_tokens", "generation_tokens")


class Metric(Protocol):
    """What the surface calls: a counter's ``inc`` or a histogram's ``observe`` (Ray's metrics have both shapes)."""

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None: ...

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None: ...


class InProcessMetric:
    """A metric kept in this process: per tag set, the sum and the number of what was recorded."""

    def __init__(self) -> None:
        self.sums: dict[tuple[tuple[str, str], ...], float] = {}
        self.counts: dict[tuple[tuple[str, str], ...], int] = {}

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.observe(value, tags)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        key = tuple(sorted((tags or {}).items()))
        self.sums[key] = self.sums.get(key, 0.0) + value
        self.counts[key] = self.counts.get(key, 0) + 1


_local: dict[str, InProcessMetric] = {name: InProcessMetric() for name in NAMES}
_installed: dict[str, Callable[[], Metric]] = {}


def install(sources: dict[str, Callable[[], Metric]]) -> None:
    """Record through ``sources`` (each name's metric, created when first asked for) from now on."""
    unknown = set(sources) - set(NAMES)
    if unknown:
        raise ValueError(f"unknown request metrics: {sorted(unknown)}")
    _installed.update(sources)


def _metric(name: str) -> Metric:
    source = _installed.get(name)
    return source() if source is not None else _local[name]


def requests() -> Metric:
    return _metric("requests")


def ttft() -> Metric:
    return _metric("ttft")


def itl() -> Metric:
    return _metric("itl")


def e2e() -> Metric:
    return _metric("e2e")


def prefix_tokens() -> Metric:
    return _metric("prefix_tokens")


def generation_tokens() -> Metric:
    return _metric("generation_tokens")

"""What Locust's table cannot show of a streamed answer, collected beside it: time to first token, inter-token
latency and output tokens/s, per kind of request and overall.

Locust's table has one row per request (``locustfile`` times it to ``[DONE]``), so its request counts and
requests/s are the true ones; these figures are printed when the run ends and, with ``--csv``, written to
``<prefix>_strata.csv``. ITL is every gap between consecutive streamed chunks (one token each), as
``vllm bench serve`` defines it.
"""

from __future__ import annotations

import csv
import json
import statistics
import threading
import urllib.error
import urllib.request
from typing import Any

FIELDS = ["name", "streams", "output_tokens", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
          "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms"]


class StreamStats:
    """Streamed requests' timings, by kind (thread-safe: Locust's users may run on threads or greenlets)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, list[tuple[float, float, list[float], int]]] = {}  # name -> (start, e2e, gaps, tokens)
        self.ttfts: dict[str, list[float]] = {}
        self.first_start: float | None = None
        self.last_end: float | None = None

    def record(self, name: str, t0: float, stamps: list[float], e2e: float) -> None:
        """One finished stream: it started at ``t0``, its chunks arrived at ``stamps``, it took ``e2e`` s."""
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        with self._lock:
            self.requests.setdefault(name, []).append((t0, e2e, gaps, len(stamps)))
            if stamps:
                self.ttfts.setdefault(name, []).append(stamps[0] - t0)
            self.first_start = t0 if self.first_start is None else min(self.first_start, t0)
            self.last_end = max(self.last_end or 0.0, t0 + e2e)

    def summary(self) -> list[dict[str, Any]]:
        """One row per kind, then ``all``: streams timed, tokens and their rate over the run's wall time, and
        latency percentiles."""
        with self._lock:
            kinds = {name: list(rows) for name, rows in self.requests.items()}
            ttfts = {name: list(v) for name, v in self.ttfts.items()}
            wall = (self.last_end or 0.0) - (self.first_start or 0.0)
        every = [r for rows in kinds.values() for r in rows]
        out = [_row(name, rows, ttfts.get(name, []), wall) for name, rows in sorted(kinds.items())]
        return out + [_row("all", every, [t for v in ttfts.values() for t in v], wall)] if every else out

    def report(self, csv_prefix: str | None) -> None:
        rows = self.summary()
        if not rows:
            return
        print("\nStrata streaming figures (requests timed to [DONE]; ITL = gaps between streamed tokens):")
        print("  ".join(f"{f:>{max(len(f), 12)}}" for f in FIELDS))
        for row in rows:
            print("  ".join(f"{_cell(row[f]):>{max(len(f), 12)}}" for f in FIELDS))
        if csv_prefix:
            with open(f"{csv_prefix}_strata.csv", "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=FIELDS)
                writer.writeheader()
                writer.writerows(rows)

    @staticmethod
    def probe_images(host: str, model: str, api_key: str | None, image_url: str) -> bool:
        """Whether the served model takes images: one one-token image chat, outside Locust's statistics. A
        model that takes none is said once; its image users then step aside instead of failing."""
        body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "hi"}]}]}
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        request = urllib.request.Request(host.rstrip("/") + "/v1/chat/completions", json.dumps(body).encode(),
                                         headers)
        try:
            with urllib.request.urlopen(request, timeout=120):
                return True
        except urllib.error.HTTPError as exc:
            message = exc.read().decode(errors="replace")
            if exc.code == 400 and "takes no images" in message:
                print(f"note: {model} takes no images: the image chat users step aside")
                return False
            return True  # another refusal: the image users run and report it, as any user would
        except OSError:
            return True


def _row(name: str, rows: list[tuple[float, float, list[float], int]], ttfts: list[float],
         wall: float) -> dict[str, Any]:
    tokens = sum(r[3] for r in rows)
    gaps = [g for r in rows for g in r[2]]
    e2es = [r[1] for r in rows]
    per_s = (lambda n: n / wall) if wall > 0 else (lambda n: 0.0)
    return {"name": name, "streams": len(rows), "output_tokens": tokens,
            "output_tokens_per_s": per_s(tokens), "ttft_p50_ms": _pct(ttfts, 50), "ttft_p99_ms": _pct(ttfts, 99),
            "itl_p50_ms": _pct(gaps, 50), "itl_p99_ms": _pct(gaps, 99), "e2e_p50_ms": _pct(e2es, 50),
            "e2e_p99_ms": _pct(e2es, 99)}


def _pct(values: list[float], q: int) -> float | None:
    """The q-th percentile in ms (None without values)."""
    if not values:
        return None
    if len(values) == 1:
        return values[0] * 1e3
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


STATS = StreamStats()

"""`strata bench soak --minutes N`: a long run of mixed traffic with client disconnects and bad
requests against a real server, watching for what only time reveals: memory that grows, KV blocks or
host-tier pins that never come back, requests that stop answering.

The run has three phases of equal length: mixed traffic; the same plus uploads that stall (each
must end in a 408, nobody else locked out); the same plus a host tier whose filesystem is full (a
tmpfs of the soak's own filled with ballast: every request still answered). Against ``--url`` the
full-tier phase is skipped (the tier is not ours to fill), and without root it cannot be mounted.

Every ``--sample-s`` seconds it records each replica's RSS (by deployment) and the KV blocks in use
per stage. At the end it waits for the server to go idle and checks that blocks in use, queued
prompt tokens and running sequences are back to their values before the run. It reports RSS growth
per deployment between the first sample after ``--warmup-minutes`` and the last one. Exit status 0
means nothing leaked and no request failed unexpectedly.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from strata.bench.soak_phases import Staller, TierBallast

KINDS = ("chat", "stream", "disconnect", "long", "bad")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=30.0, help="length of the traffic phase")
    p.add_argument("--warmup-minutes", type=float, default=None,
                   help="RSS growth is measured from here on (default: a tenth of the run)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--mode", choices=("aggregated", "disaggregated"), default="disaggregated")
    p.add_argument("--model", type=Path, help="checkpoint (default: the tiny demo model)")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS / KV samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="an already running `strata serve` (default: start one for the run)")
    p.add_argument("--dashboard-url", help="its Ray dashboard, for the replicas' pids (with --url)")
    p.add_argument("--json", type=Path)
    p.add_argument("--tier-mb", type=int, default=64, help="size of the soak's own host-tier tmpfs (full-tier phase)")


class Traffic:
    """Client threads sending a weighted mix of request kinds until told to stop; counts outcomes."""

    WEIGHTS = {"chat": 4, "stream": 4, "disconnect": 2, "long": 1, "bad": 1}

    def __init__(self, url: str, model: str, seed: int, long_words: int) -> None:
        self.url, self.model, self.long_words = url, model, long_words
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def _count(self, key: str) -> None:
        with self.lock:
            self.outcomes[key] += 1

    def _body(self, words: int, **extra: Any) -> dict[str, Any]:
        text = " ".join(f"w{self.rng.randrange(500)}" for _ in range(words))
        return {"model": self.model, "messages": [{"role": "user", "content": text}], "max_tokens": 24, **extra}

    def one(self, client: httpx.Client, kind: str) -> None:
        url = self.url + "/v1/chat/completions"
        try:
            if kind == "bad":
                r = client.post(url, json={**self._body(4), "max_tokens": -1})
                self._count(f"bad:{r.status_code}")
            elif kind in ("stream", "disconnect"):
                with client.stream("POST", url, json=self._body(16, stream=True, max_tokens=64)) as r:
                    lines = 0
                    for line in r.iter_lines():
                        lines += bool(line.strip())
                        if kind == "disconnect" and lines >= 3:
                            break  # hang up mid-stream
                    self._count(f"{kind}:{r.status_code}")
            else:
                r = client.post(url, json=self._body(self.long_words if kind == "long" else 16))
                self._count(f"{kind}:{r.status_code}")
        except httpx.HTTPError as exc:
            self._count(f"{kind}:{type(exc).__name__}")

    def run_client(self) -> None:
        kinds, weights = zip(*self.WEIGHTS.items())
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                with self.lock:
                    kind = self.rng.choices(kinds, weights)[0]
                self.one(client, kind)

    def unexpected(self) -> dict[str, int]:
        """Outcomes that should not happen: anything but 200 (400 for the bad requests, 408 for stalled
        uploads)."""
        ok = {f"{k}:200" for k in KINDS if k != "bad"} | {"bad:400", "slowbody:408"}
        return {k: v for k, v in self.outcomes.items() if k not in ok}


def _replica_rss(server: Any) -> dict[str, float]:
    """MiB of resident memory per deployment (summed over its replicas), from the replicas' pids."""
    import psutil

    apps = httpx.get(server.dashboard_url + "/api/serve/applications/", timeout=30).json()["applications"]
    out: dict[str, float] = {}
    for name, dep in apps["strata"]["deployments"].items():
        total = 0.0
        for replica in dep["replicas"]:
            try:
                total += psutil.Process(replica["pid"]).memory_info().rss / 2**20
            except (psutil.Error, KeyError, TypeError):
                pass
        out[name] = total
    return out


def _kv(server: Any) -> dict[str, Any]:
    stats = httpx.get(server.base_url + "/strata/stats", timeout=30).json()
    out = {}
    for stage in ("prefill", "decode"):
        s = stats.get(stage, {})
        out[stage] = {"in_use": s.get("kv", {}).get("device", {}).get("in_use"), "running": s.get("running", 0),
                      "queued_prompt_tokens": s.get("queued_prompt_tokens", 0)}
    return out


def _host_write_errors(server: Any) -> int | None:
    """Writes the host tier refused so far (prefill's view; None without a host tier)."""
    try:
        stats = httpx.get(server.base_url + "/strata/stats", timeout=30).json()
        return int(stats["prefill"]["kv"]["tiers"]["host"]["write_errors"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def _idle_state(kv: dict[str, Any]) -> dict[str, Any]:
    return {stage: (v["in_use"], v["running"], v["queued_prompt_tokens"]) for stage, v in kv.items()}


def run(args: argparse.Namespace) -> int:
    from strata.local_server import LocalServer
    from strata.checkpoints.tiny_model import ensure_demo_model

    if args.url and not args.dashboard_url:
        raise ValueError("--url needs --dashboard-url (the replicas' RSS is read through the Ray dashboard)")
    warmup_s = 60 * (args.warmup_minutes if args.warmup_minutes is not None else args.minutes / 10)
    ballast: TierBallast | None = None
    if args.url:
        server: Any = argparse.Namespace(base_url=args.url.rstrip("/"), dashboard_url=args.dashboard_url.rstrip("/"),
                                         stop=lambda: None)
        where = f"the server at {server.base_url}"
    else:
        model = args.model or ensure_demo_model()
        work = Path(tempfile.mkdtemp(prefix="strata-soak-"))
        config: dict[str, Any] = {"mode": args.mode, "request_body_timeout_s": 5}
        ballast = TierBallast(work / "host", args.tier_mb)
        ballast.mount()
        config["engine"] = {"host_kv_blocks": 4096, "host_kv_dir": str(work / "host")}
        server = LocalServer(model, work / "server", config, env={"RAY_AUTH_MODE": "disabled"})
        stop_server = server.stop
        server.stop = lambda: (stop_server(), ballast.unmount())  # type: ignore[union-attr]
        server.wait_ready()
        where = f"a {args.mode} server of {model.name} started for the run"
    full_tier = ("skipped: the tier of a server given by --url is not ours to fill" if ballast is None
                 else f"skipped: {ballast.skipped}" if ballast.skipped else f"a {args.tier_mb} MB tmpfs filled with ballast")
    print(f"# strata bench soak: {args.minutes:g} min of mixed traffic ({', '.join(f'{k} x{w}' for k, w in Traffic.WEIGHTS.items())}),"
          f" {args.concurrency} clients, {where}; samples every {args.sample_s:g} s;"
          f" RSS growth measured after {warmup_s / 60:g} min of warm-up", flush=True)
    print(f"# phases of {args.minutes / 3:g} min: mixed; + 4 stalled uploads at a time; + a full host tier ({full_tier})",
          flush=True)
    samples: list[dict[str, Any]] = []
    try:
        try:
            served = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]
            _replica_rss(server)
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            raise ValueError(f"no Strata server (with its Ray dashboard) answers at {server.base_url} / "
                             f"{server.dashboard_url} ({type(exc).__name__})") from None
        baseline = _kv(server)
        # long prompts fill about a third of the context (a few tokens per word with any tokenizer)
        traffic = Traffic(server.base_url, served["id"], args.seed, long_words=served.get("max_model_len", 2048) // 12)
        clients = [threading.Thread(target=traffic.run_client, daemon=True) for _ in range(args.concurrency)]
        staller = Staller(server.base_url)
        phase = 0
        tier_errors_before_full: int | None = None
        t0 = time.monotonic()
        for c in clients:
            c.start()
        print(f"{'t (s)':>7} {'requests':>9} " + " ".join(f"{n + ' MiB':>14}" for n in _replica_rss(server))
              + f" {'prefill blk':>12} {'decode blk':>11}", flush=True)
        total_s, next_sample = args.minutes * 60, args.sample_s
        while (elapsed := time.monotonic() - t0) < total_s:
            now_phase = min(2, int(3 * elapsed / total_s))
            if now_phase >= 1 and phase < 1:
                staller.start()
                print(f"# {elapsed:.0f} s: uploads start stalling", flush=True)
            if now_phase >= 2 and phase < 2 and ballast is not None and ballast.mounted:
                tier_errors_before_full = _host_write_errors(server)
                filled = ballast.fill()
                how = f"{filled / 2**20:.0f} MiB of ballast" if filled >= 2**20 else "traffic had filled it already"
                print(f"# {elapsed:.0f} s: host tier full ({how})", flush=True)
            phase = now_phase
            if elapsed < min(next_sample, total_s - 0.05):
                time.sleep(min(0.25, max(0.0, next_sample - elapsed)))
                continue
            next_sample += args.sample_s
            sample = {"t_s": time.monotonic() - t0, "requests": sum(traffic.outcomes.values()),
                      "rss_mib": _replica_rss(server), "kv": _kv(server)}
            samples.append(sample)
            print(f"{sample['t_s']:7.0f} {sample['requests']:9d} "
                  + " ".join(f"{v:14.0f}" for v in sample["rss_mib"].values())
                  + f" {sample['kv']['prefill']['in_use']!s:>12} {sample['kv']['decode']['in_use']!s:>11}", flush=True)
        traffic.stop.set()
        for c in clients:
            c.join(timeout=150)
        staller.join()
        traffic.outcomes.update(staller.outcomes)
        tier_errors_at_end = _host_write_errors(server)
        if ballast is not None:
            ballast.empty()
        deadline, idle = time.monotonic() + 120, _kv(server)
        while _idle_state(idle) != _idle_state(baseline) and time.monotonic() < deadline:
            time.sleep(1)
            idle = _kv(server)
        final_rss = _replica_rss(server)
    finally:
        server.stop()
    full = None
    if tier_errors_before_full is not None and tier_errors_at_end is not None:
        full = tier_errors_at_end - tier_errors_before_full
        print(f"# full-tier phase: the host tier refused {full} writes; every request was still answered "
              "as counted below", flush=True)
    return _report(args, samples, baseline, idle, final_rss, traffic, warmup_s, full)


def _report(args: argparse.Namespace, samples: list[dict[str, Any]], baseline: dict[str, Any], idle: dict[str, Any],
            final_rss: dict[str, float], traffic: Traffic, warmup_s: float, full_tier_refusals: int | None) -> int:
    after_warmup = [s for s in samples if s["t_s"] >= warmup_s] or samples[-1:]
    growth = {}
    for name, last in final_rss.items():
        first = after_warmup[0]["rss_mib"].get(name, last) if after_warmup else last
        growth[name] = {"after_warmup_mib": first, "end_mib": last, "growth_mib": last - first,
                        "growth_pct": 100 * (last - first) / first if first else 0.0}
    kv_back = _idle_state(idle) == _idle_state(baseline)
    unexpected = traffic.unexpected()
    total = sum(traffic.outcomes.values())
    print(f"\n# {total} requests: " + ", ".join(f"{k} {v}" for k, v in sorted(traffic.outcomes.items())))
    print("# RSS per deployment, after warm-up -> end: " + "; ".join(
        f"{n} {g['after_warmup_mib']:.0f} -> {g['end_mib']:.0f} MiB ({g['growth_pct']:+.1f}%)" for n, g in growth.items()))
    print(f"# KV after the run (blocks in use, running, queued prompt tokens): {_idle_state(idle)}; "
          f"before: {_idle_state(baseline)} -> {'back to baseline' if kv_back else 'LEAKED'}")
    if unexpected:
        print(f"# unexpected outcomes: {unexpected}")
    if samples:
        rate = total / max(samples[-1]["t_s"], 1e-9)
        print(f"# throughput {rate:.1f} requests/s; median sample interval "
              f"{statistics.median(b['t_s'] - a['t_s'] for a, b in zip(samples, samples[1:])) if len(samples) > 1 else 0:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "baseline": baseline, "idle": idle, "rss": growth,
                                         "outcomes": dict(traffic.outcomes), "kv_back_to_baseline": kv_back,
                                         "unexpected": unexpected, "full_tier_refused_writes": full_tier_refusals},
                                        indent=2))
    return 0 if kv_back and not unexpected else 1

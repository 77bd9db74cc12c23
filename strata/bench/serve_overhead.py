"""`strata bench serve-overhead`: what the Serve path (HTTP + proxy + ingress + four stage
replicas + KV hand-off through the host tier) adds to time-to-first-token and inter-token
latency, against the in-process engine on the same model, the same prompts and the same
concurrency, measured side by side in one run.

Both sides stream text: TTFT is the time to the first non-empty text delta; TPOT is a
request's mean gap between text deltas after the first (robust to deltas that arrive in
bursts); ITL is every single gap. Greedy, ignore EOS, fixed prompt and output lengths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from strata.pipeline.config import EngineConfig
from strata.pipeline.sampling_params import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="checkpoint (default: the tiny demo model)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--url", help="an already running `strata serve` (default: start one for the run)")
    p.add_argument("--json", type=Path)


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _summary(ttfts: list[float], gaps: list[list[float]]) -> dict[str, float]:
    itls = [g for request in gaps for g in request]
    tpots = [sum(request) / len(request) for request in gaps if request]
    return {"ttft_p50_ms": statistics.median(ttfts) * 1e3, "ttft_p99_ms": _percentile(ttfts, 0.99) * 1e3,
            "tpot_p50_ms": statistics.median(tpots) * 1e3,
            "itl_p50_ms": statistics.median(itls) * 1e3, "itl_p99_ms": _percentile(itls, 0.99) * 1e3}


def _prompts(n: int, words: int) -> list[str]:
    return [f"Request {i}: " + " ".join(f"wave{(i * 7 + j) % 97}" for j in range(words)) for i in range(n)]


def _in_process(model: Path, prompts: list[str], concurrency: int, out_tokens: int) -> dict[str, float]:
    from strata.stages.factory import build_engine

    engine = build_engine(model, EngineConfig())
    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([{"prompt": "warm up", "params": SamplingParams(max_tokens=2, temperature=0)}])
    ttfts, itls = [], []
    for start in range(0, len(prompts), concurrency):
        batch = prompts[start : start + concurrency]
        t0 = time.perf_counter()
        ids = [engine.add_request(prompt=p, params=params) for p in batch]
        last: dict[str, float] = {}
        gaps: dict[str, list[float]] = {i: [] for i in ids}
        for out in engine.run():
            if not out.text_delta:
                continue
            now = time.perf_counter()
            if out.request_id in last:
                gaps[out.request_id].append(now - last[out.request_id])
            else:
                ttfts.append(now - t0)
            last[out.request_id] = now
        itls.extend(gaps.values())
    return _summary(ttfts, itls)


def _one_stream(url: str, model: str, prompt: str, out_tokens: int, t0: float, ttfts: list, itls: list) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": out_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    last, gaps = None, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if not choices[0].get("delta", {}).get("content"):
                continue
            now = time.perf_counter()
            (gaps.append(now - last) if last is not None else ttfts.append(now - t0))
            last = now
    itls.append(gaps)


def _served(url: str, prompts: list[str], concurrency: int, out_tokens: int) -> dict[str, float]:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    _one_stream(url, model, "warm up", 2, time.perf_counter(), [], [])
    ttfts: list[float] = []
    itls: list[float] = []
    for start in range(0, len(prompts), concurrency):
        t0 = time.perf_counter()
        threads = [threading.Thread(target=_one_stream, args=(url, model, p, out_tokens, t0, ttfts, itls))
                   for p in prompts[start : start + concurrency]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return _summary(ttfts, itls)


def run(args: argparse.Namespace) -> int:
    from strata.pipeline.tiny_model import ensure_demo_model

    model = args.model or ensure_demo_model()
    server = None
    url = args.url
    if url is None:
        import tempfile

        from strata.local_server import LocalServer

        work = Path(tempfile.mkdtemp(prefix="strata-bench-serve-"))
        config = {"engine": {"host_kv_blocks": 4096, "host_kv_dir": str(work / "host")},
                  "stages": {"ingress": {"max_ongoing_requests": 1024}}}
        server = LocalServer(model, work, config, env={"RAY_AUTH_MODE": "disabled"}).wait_ready()
        url = server.base_url
    results: dict[str, Any] = {"levels": []}
    print(f"# Serve path vs in-process engine: {args.requests} requests per level, ~{args.prompt_words}-word prompts, "
          f"{args.output_tokens} output tokens, greedy, ignore EOS; text-delta timing on both sides")
    print(f"{'conc':>5} {'TTFT p50 in-proc':>17} {'TTFT p50 serve':>15} {'added':>9} {'TPOT p50 in-proc':>17} "
          f"{'TPOT p50 serve':>15} {'ratio':>7} {'ITL p50 in/serve':>17}")
    try:
        for conc in args.concurrency:
            prompts = _prompts(args.requests, args.prompt_words)
            local = _in_process(model, prompts, conc, args.output_tokens)
            served = _served(url, prompts, conc, args.output_tokens)
            row = {"concurrency": conc, "in_process": local, "serve": served,
                   "ttft_added_ms": served["ttft_p50_ms"] - local["ttft_p50_ms"],
                   "tpot_ratio": served["tpot_p50_ms"] / local["tpot_p50_ms"]}
            results["levels"].append(row)
            print(f"{conc:>5} {local['ttft_p50_ms']:>14.1f} ms {served['ttft_p50_ms']:>12.1f} ms "
                  f"{row['ttft_added_ms']:>6.1f} ms {local['tpot_p50_ms']:>14.2f} ms {served['tpot_p50_ms']:>12.2f} ms "
                  f"{row['tpot_ratio']:>6.2f}x {local['itl_p50_ms']:>7.2f}/{served['itl_p50_ms']:.2f} ms", flush=True)
    finally:
        if server is not None:
            server.stop()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    sys.stdout.flush()
    return 0

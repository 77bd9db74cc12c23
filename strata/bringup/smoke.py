"""`strata smoke --model DIR`: serve the checkpoint for real and check what a user relies on.

Starts `strata serve` on free loopback ports in its own temporary Ray cluster, then, through the
official ``openai`` client: a text and an image request, streamed and not, whose greedy text must
equal the in-process engine's; a malformed request that must get a 400; a client that hangs up
mid-stream, whose blocks must come back; and ``/metrics``, which must show the traffic. Stops the
server and prints a pass/fail table with the load time, time to first token and tokens/s.
Exit 0 when every check passes.
"""

from __future__ import annotations

import argparse
import base64
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx

PROMPT = "Tell me a story about the sea."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the tiny demo model)")
    p.add_argument("--mode", choices=("aggregated", "disaggregated"), default="aggregated")
    p.add_argument("--max-tokens", type=int, default=16)


def _requests_total(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ray_strata_requests_total{") and 'status="200"' in line)


def _in_use(base_url: str) -> int:
    stats = httpx.get(base_url + "/strata/stats", timeout=30).json()
    return sum(stats[s]["kv"]["device"]["in_use"] for s in {"prefill", "decode"} if "kv" in stats.get(s, {}))


class Checks:
    """Named checks, each timed; a check fails on an exception or a False result."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, bool, float, str]] = []

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            result = fn()
            ok, detail = (result if isinstance(result, tuple) else (bool(result), ""))
        except Exception as exc:  # a failed check is a row of the table, never a traceback
            ok, detail, result = False, f"{type(exc).__name__}: {exc}"[:200], None
        self.rows.append((name, ok, time.perf_counter() - t0, detail))
        return result


def run(args: argparse.Namespace) -> int:
    import openai

    from strata.local_server import LocalServer
    from strata.pipeline.contract.config import EngineConfig
    from strata.pipeline.contract.sampling_params import SamplingParams
    from strata.stages.factory import build_engine
    from strata.checkpoints.tiny_model import ensure_demo_model, make_demo_image

    model = args.model or ensure_demo_model()
    work = Path(tempfile.mkdtemp(prefix="strata-smoke-"))
    image = make_demo_image(work / "demo.png", 64).read_bytes()
    image_part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}
    cases = {"text": [{"role": "user", "content": PROMPT}],
             "image": [{"role": "user", "content": [image_part, {"type": "text", "text": "What is in the picture?"}]}]}
    engine = build_engine(model, EngineConfig())
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    expected = {k: "".join(engine.stream(messages=m, images=[image] if k == "image" else [], params=greedy))
                for k, m in cases.items()}
    del engine
    config: dict[str, Any] = {"mode": args.mode}
    if args.mode == "disaggregated":
        config["engine"] = {"host_kv_blocks": 1024, "host_kv_dir": str(work / "host")}
    print(f"# strata smoke: {model.name}, {args.mode} mode, a real server on loopback, the openai client", flush=True)
    checks = Checks()
    t0 = time.perf_counter()
    server = LocalServer(model, work / "server", config,
                         env={"RAY_AUTH_MODE": "disabled", "RAY_metrics_report_interval_ms": "1000"})
    try:
        if checks.run("server starts and is healthy", server.wait_ready) is None:
            print(server.tail(20))  # why it did not come up
            return _report(checks, {"load_s": time.perf_counter() - t0})
        timings: dict[str, float] = {"load_s": time.perf_counter() - t0}
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        name = checks.run("/v1/models lists the model", lambda: client.models.list().data[0].id)
        if name is None:
            return _report(checks, timings)
        try:
            before: float | None = _requests_total(server.metrics_url)
        except httpx.HTTPError:
            before = None  # reported by the metrics check below

        def whole(kind: str) -> tuple[bool, str]:
            r = client.chat.completions.create(model=name, messages=cases[kind], max_tokens=args.max_tokens, temperature=0)
            got = r.choices[0].message.content or ""
            return got == expected[kind], f"{got!r} vs in-process {expected[kind]!r}"[:120]

        def streamed(kind: str) -> tuple[bool, str]:
            t = time.perf_counter()
            stamps, text = [], []
            for chunk in client.chat.completions.create(model=name, messages=cases[kind], max_tokens=args.max_tokens,
                                                        temperature=0, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.perf_counter() - t)
                    text.append(chunk.choices[0].delta.content)
            if stamps and kind == "text":
                timings["ttft_s"] = stamps[0]
                timings["tokens_per_s"] = (len(stamps) - 1) / max(stamps[-1] - stamps[0], 1e-9) if len(stamps) > 1 else 0.0
            got = "".join(text)
            return got == expected[kind], f"{got!r} vs in-process {expected[kind]!r}"[:120]

        for kind in cases:
            checks.run(f"{kind}: greedy text equals the engine's", lambda k=kind: whole(k))
            checks.run(f"{kind}, streamed: equals the engine's", lambda k=kind: streamed(k))

        def malformed() -> tuple[bool, str]:
            r = httpx.post(server.base_url + "/v1/chat/completions", content=b"{not json",
                           headers={"content-type": "application/json"}, timeout=30)
            return r.status_code == 400 and "error" in r.json(), f"HTTP {r.status_code}"

        checks.run("a malformed request gets a 400", malformed)

        def disconnect() -> tuple[bool, str]:
            baseline = _in_use(server.base_url)
            body = {"model": name, "messages": cases["text"], "max_tokens": 4000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                for _ in range(4):
                    next(lines)
            deadline = time.monotonic() + 30
            while (now := _in_use(server.base_url)) != baseline and time.monotonic() < deadline:
                time.sleep(0.2)
            return now == baseline, f"device blocks in use {now} (before {baseline})"

        checks.run("a client disconnect frees its blocks", disconnect)

        def metrics() -> tuple[bool, str]:
            if before is None:
                return False, "/metrics did not answer"
            deadline = time.monotonic() + 30
            while (now := _requests_total(server.metrics_url)) < before + 4 and time.monotonic() < deadline:
                time.sleep(1)
            return now >= before + 4, f"strata_requests_total (200) {before:.0f} -> {now:.0f}"

        checks.run("/metrics shows the traffic", metrics)
    finally:
        server.stop()  # also when it never became healthy: nothing is left running
    checks.rows.append(("server stops", server.proc.returncode == 0, 0.0, f"exit {server.proc.returncode}"))
    return _report(checks, timings)


def _report(checks: Checks, timings: dict[str, float]) -> int:
    width = max(len(r[0]) for r in checks.rows)
    for name, ok, seconds, detail in checks.rows:
        print(f"{name:<{width}}  {'PASS' if ok else 'FAIL'}  {seconds:6.2f} s  {detail if not ok else ''}".rstrip())
    print(f"# load {timings['load_s']:.1f} s" + (f", first token {timings['ttft_s'] * 1e3:.0f} ms, "
          f"{timings['tokens_per_s']:.0f} tokens/s (one stream)" if "ttft_s" in timings else ""))
    failed = [r[0] for r in checks.rows if not r[1]]
    print(f"FAIL: {', '.join(failed)}" if failed else f"PASS: all {len(checks.rows)} checks")
    return 1 if failed else 0

"""Short real load runs against the real server: Locust headless and `strata bench serve`."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import strata.loadtest
from helpers import run_strata

BENCH_METRICS = [
    "request_throughput", "output_throughput", "total_token_throughput", "goodput",
    *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p99")),
]


def test_headless_locust_run_has_no_failures(serve_server, tmp_path: Path) -> None:
    """One Locust row per request, timed to its [DONE] (so Aggregated counts requests, not four entries a
    request); TTFT, ITL and the token and request rates in the streaming figures beside it."""
    locust = Path(sys.executable).with_name("locust")
    prefix = tmp_path / "strata"
    proc = subprocess.run(
        [str(locust), "-f", str(Path(strata.loadtest.__file__).with_name("locustfile.py")), "--headless", "-u", "6", "-r", "6", "-t", "12s",
         "--host", serve_server.base_url, "--csv", str(prefix), "--only-summary"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, env={**os.environ, "STRATA_LONG_PROMPT_WORDS": "120"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["Name"]: r for r in csv.DictReader(open(f"{prefix}_stats.csv"))}
    kinds = ("text chat", "image chat", "multi-turn chat", "long prompt")
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    for name in kinds:
        assert int(rows[name]["Request Count"]) > 0, f"no {name} requests ran"
    requests = sum(int(rows[name]["Request Count"]) for name in kinds)
    assert int(rows["Aggregated"]["Request Count"]) == requests + int(rows["/v1/models"]["Request Count"])
    figures = {r["name"]: r for r in csv.DictReader(open(f"{prefix}_strata.csv"))}
    # every finished stream is timed (but for one a user that Locust's stop may cut between its row and here)
    assert int(figures["all"]["streams"]) >= requests - 6 and float(figures["all"]["output_tokens_per_s"]) > 0
    for name in ("text chat", "long prompt"):
        assert float(figures[name]["ttft_p50_ms"]) > 0 and float(figures[name]["itl_p50_ms"]) > 0
        # the row times the whole stream: never shorter than its time to the first token
        assert float(rows[name]["Median Response Time"]) >= float(figures[name]["ttft_p50_ms"]) * 0.9
    assert "Strata streaming figures" in proc.stdout + proc.stderr


def test_image_users_step_aside_on_a_model_that_takes_no_images() -> None:
    """Against a text-only server the probe says so once, and no image request is made (none fails)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from strata.loadtest.stream_stats import StreamStats

    class TextOnly(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.dumps({"error": {"message": "this model takes no images", "type": "invalid_request_error"}})
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), TextOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        host = f"http://127.0.0.1:{server.server_port}"
        assert StreamStats.probe_images(host, "m", None, "data:image/png;base64,AAAA") is False
    finally:
        server.shutdown()
    assert StreamStats.probe_images("http://127.0.0.1:9", "m", None, "data:,") is True  # unreachable: users report it


@pytest.mark.parametrize("dataset", ["random", "random-mm", "prefix-repetition"])
def test_bench_serve_reports_every_metric(serve_server, tmp_path: Path, dataset: str) -> None:
    args = ["bench", "serve", "--base-url", serve_server.base_url, "--dataset", dataset, "--num-prompts", "8",
            "--random-input-len", "32", "--random-output-len", "8", "--prefix-len", "64",
            "--goodput", "ttft:60000", "tpot:60000", "--result-dir", str(tmp_path), "--no-progress"]
    if dataset == "random":
        args += ["--sweep", "1", "4", "--request-rate", "50"]
    if dataset == "random-mm":  # two images of mixed sizes per request
        args += ["--mm-images-per-request", "2", "--mm-image-sizes", "64x64", "640x480"]
    proc = run_strata(*args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (result,) = tmp_path.glob("bench-*.json")
    runs = json.loads(result.read_text())["runs"]
    assert len(runs) == (2 if dataset == "random" else 1)
    for run in runs:
        assert run["failed"] == 0 and run["completed"] == 8
        for metric in BENCH_METRICS:
            assert run[metric] is not None and run[metric] == run[metric], metric  # present and not NaN
        assert run["total_output_tokens"] == 8 * 8  # ignore_eos: every request ran to max_tokens
        assert run["goodput"] == pytest.approx(run["request_throughput"])  # generous SLOs: every request is good
    if dataset == "random":
        run_id = result.name.removeprefix("bench-random-").removesuffix(".json")
        for kind in ("latency", "throughput"):  # plots carry the run id, so two runs never overwrite each other
            assert (tmp_path / f"{kind}_vs_concurrency-{run_id}.png").stat().st_size > 1000
    assert "Request throughput (req/s):" in proc.stdout and "P99 TTFT (ms):" in proc.stdout
    assert "Tokens per stream event:" in proc.stdout
    for run in runs:  # ITL as an independent client computes it, and how many tokens an event carried
        assert run["mean_itl_ms"] == pytest.approx(run["mean_tpot_ms"]) and run["tokens_per_event"] >= 1.0
    if dataset == "random":  # --random-input-len counts the model's tokens (plus the chat template's few)
        assert all(32 <= run["total_input_tokens"] / 8 <= 44 for run in runs), [r["total_input_tokens"] for r in runs]

"""After real traffic, Ray's Prometheus endpoint shows the strata_ metrics, moved by that traffic."""

from __future__ import annotations

import re
import time

import httpx

from helpers import metric_value, scrape_metrics

MODEL = "strata-test"


def _scrape(server) -> dict[str, float]:
    return scrape_metrics(server.metrics_url)


_value = metric_value


def _unique_png() -> str:
    """A PNG no earlier test sent (a fresh colour per run), base64."""
    import base64
    import io
    import os

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 48), tuple(os.urandom(3))).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _wait_for(server, check, timeout: float = 45.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = _scrape(server)
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(1)


def _ongoing(server) -> int:
    return httpx.get(server.base_url + "/strata/stats", timeout=30).json()["ingress"]["ongoing_requests"]


def _settled(server) -> dict[str, float]:
    """Scrape until no request of an earlier test is still open (one whose client left is counted as a 499
    only when the server notices) and three scrapes over 6 s agree: their traffic has been exported (the
    export runs every second, but a loaded machine delays it by seconds; two scrapes 2 s apart once agreed
    while two late 499s were still on their way)."""
    previous, quiet = _scrape(server), 0
    for _ in range(40):
        time.sleep(3)
        current = _scrape(server)
        quiet = quiet + 1 if current == previous and _ongoing(server) == 0 else 0
        if quiet == 2:
            return current
        previous = current
    return previous


def test_metrics_follow_the_traffic(serve_server) -> None:
    before = _settled(serve_server)
    ok_before = _value(before, "ray_strata_requests_total", endpoint="chat", status="200")
    bad_before = _value(before, "ray_strata_requests_total", endpoint="chat", status="404")
    hits_before = _value(before, "ray_strata_prefix_cache_tokens_total", kind="hit")
    cancelled_before = _value(before, "ray_strata_requests_total", endpoint="chat", status="499")
    e2e_before = _value(before, "ray_strata_e2e_request_latency_seconds_count", endpoint="chat")
    enc_hits_before = _value(before, "ray_strata_encoder_cache_total", result="hit")
    enc_misses_before = _value(before, "ray_strata_encoder_cache_total", result="miss")
    shared = "Keep this ship's manifest in mind: " + ", ".join(f"crate {i}" for i in range(40))
    url = serve_server.base_url + "/v1/chat/completions"
    n = 6
    for i in range(n):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"{shared}. Question {i}?"}],
                "max_tokens": 4, "stream": i % 2 == 0}
        assert httpx.post(url, json=body, timeout=60).status_code == 200
    assert httpx.post(url, json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}).status_code == 404
    # The same new image twice: one encoder-cache miss, then one hit.
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _unique_png()}}
    for _ in range(2):
        body = {"model": MODEL, "messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}],
                "max_tokens": 2}
        assert httpx.post(url, json=body, timeout=60).status_code == 200
    n += 2
    # A stream read to its [DONE] and closed at once is a complete request (200), not a cancelled one.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "one more"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert any(line == "data: [DONE]" for line in r.iter_lines())
    n += 1

    def moved(s: dict[str, float]) -> bool:
        return (_value(s, "ray_strata_requests_total", endpoint="chat", status="200") >= ok_before + n
                and _value(s, "ray_strata_prefix_cache_tokens_total", kind="hit") > hits_before
                and _value(s, "ray_strata_time_to_first_token_seconds_count") >= n
                and _value(s, "ray_strata_encoder_cache_total", result="hit") > enc_hits_before)

    after = _wait_for(serve_server, moved)
    assert _value(after, "ray_strata_requests_total", endpoint="chat", status="200") == ok_before + n
    assert _value(after, "ray_strata_requests_total", endpoint="chat", status="404") == bad_before + 1
    assert _value(after, "ray_strata_requests_total", endpoint="chat", status="499") == cancelled_before
    assert _value(after, "ray_strata_encoder_cache_total", result="miss") == enc_misses_before + 1
    assert _value(after, "ray_strata_encoder_cache_total", result="hit") == enc_hits_before + 1
    assert _value(after, "ray_strata_e2e_request_latency_seconds_count", endpoint="chat") == e2e_before + n
    assert _value(after, "ray_strata_prefix_cache_tokens_total", kind="hit") > hits_before  # the repeated prefix hit
    assert _value(after, "ray_strata_prefix_cache_tokens_total", kind="queried") > 0
    assert _value(after, "ray_strata_time_to_first_token_seconds_count") >= n
    assert _value(after, "ray_strata_e2e_request_latency_seconds_count") >= n
    assert _value(after, "ray_strata_inter_token_latency_seconds_count") >= n  # 4 tokens each: 3 gaps
    assert _value(after, "ray_strata_stage_processing_seconds_count", stage="prefill") >= n
    assert _value(after, "ray_strata_kv_blocks", stage="decode", tier="host", state="stored") > 0
    assert any(k.startswith("ray_strata_stage_queue_depth{") for k in after)
    assert any(k.startswith("ray_strata_autoscaling_target_replicas{") for k in after)
    _the_api_port_adds_vllms_names(serve_server, after, n)


def _the_api_port_adds_vllms_names(server, after: dict[str, float], n: int) -> None:
    """/metrics on the API port: Strata's series and, beside them, vLLM's families labelled with the model,
    valid exposition text a vLLM dashboard reads (``vllm_metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    got = {(s.name, s.labels.get("model_name")): s.value for f in text_string_to_metric_families(text)
           for s in f.samples if s.name.startswith("vllm:") and "le" not in s.labels}
    assert got[("vllm:prompt_tokens_total", MODEL)] >= _value(after, "ray_strata_prefix_cache_tokens_total",
                                                                kind="queried") > 0
    assert got[("vllm:generation_tokens_total", MODEL)] >= n  # every request streamed at least one token
    assert got[("vllm:time_to_first_token_seconds_count", MODEL)] >= n
    assert got[("vllm:e2e_request_latency_seconds_count", MODEL)] >= n
    assert 0.0 <= got[("vllm:kv_cache_usage_perc", MODEL)] <= 1.0
    assert ("vllm:num_requests_running", MODEL) in got and ("vllm:num_requests_waiting", MODEL) in got


def test_the_grafana_dashboard_only_queries_metrics_we_export() -> None:
    import inspect
    import json as _json
    from pathlib import Path

    from strata.deployments.ray_serve import metrics

    dashboard = _json.loads((Path(metrics.__file__).parent / "grafana" / "strata_dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m.removeprefix("ray_") for e in exprs for m in re.findall(r"ray_strata_\w+", e)}
    defined = set(re.findall(r'"(strata_\w+)"', inspect.getsource(metrics)))
    suffixes = ("_total", "_bucket", "_count", "_sum")
    for name in used:
        base = next((name[: -len(s)] for s in suffixes if name.endswith(s) and name[: -len(s)] in defined), name)
        assert base in defined, f"dashboard queries {name}, which Strata does not export"
    assert len(dashboard["panels"]) >= 10

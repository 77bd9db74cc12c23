"""vLLM's metric names computed from Strata's series (``deployments.ray_serve.vllm_metrics``), on a node's
Prometheus text as Ray's agent writes it: several processes' series of one family, labels that vary per
process, histograms whose buckets add up across series."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from strata.deployments.ray_serve.vllm_metrics import vllm_metrics

pytestmark = pytest.mark.unit

W1, W2 = 'WorkerId="a",SessionName="s"', 'WorkerId="b",SessionName="s"'
NODE_TEXT = f"""# HELP ray_strata_engine_requests Requests in a stage's engine
# TYPE ray_strata_engine_requests gauge
ray_strata_engine_requests{{{W1},stage="decode",state="running"}} 3.0
ray_strata_engine_requests{{{W2},stage="decode",state="running"}} 2.0
ray_strata_engine_requests{{{W1},stage="prefill",state="waiting"}} 4.0
ray_strata_engine_requests{{{W1},stage="prefill",state="running"}} 9.0
# HELP ray_strata_kv_cache_usage Share of device KV blocks in use
# TYPE ray_strata_kv_cache_usage gauge
ray_strata_kv_cache_usage{{{W1},stage="decode"}} 0.25
ray_strata_kv_cache_usage{{{W2},stage="decode"}} 0.5
ray_strata_kv_cache_usage{{{W1},stage="prefill"}} 0.9
# HELP ray_strata_prefix_cache_tokens_total Prompt tokens
# TYPE ray_strata_prefix_cache_tokens_total counter
ray_strata_prefix_cache_tokens_total{{{W1},kind="queried"}} 100.0
ray_strata_prefix_cache_tokens_total{{{W2},kind="queried"}} 50.0
ray_strata_prefix_cache_tokens_total{{{W1},kind="hit"}} 32.0
# HELP ray_strata_generation_tokens_total Tokens generated
# TYPE ray_strata_generation_tokens_total counter
ray_strata_generation_tokens_total{{{W1},endpoint="chat"}} 40.0
ray_strata_generation_tokens_total{{{W1},endpoint="completions"}} 2.0
# HELP ray_strata_time_to_first_token_seconds Time to first token
# TYPE ray_strata_time_to_first_token_seconds histogram
ray_strata_time_to_first_token_seconds_bucket{{{W1},endpoint="chat",le="0.1"}} 1.0
ray_strata_time_to_first_token_seconds_bucket{{{W1},endpoint="chat",le="+Inf"}} 3.0
ray_strata_time_to_first_token_seconds_bucket{{{W2},endpoint="completions",le="0.1"}} 2.0
ray_strata_time_to_first_token_seconds_bucket{{{W2},endpoint="completions",le="+Inf"}} 2.0
ray_strata_time_to_first_token_seconds_sum{{{W1},endpoint="chat"}} 1.5
ray_strata_time_to_first_token_seconds_sum{{{W2},endpoint="completions"}} 0.1
ray_strata_time_to_first_token_seconds_count{{{W1},endpoint="chat"}} 3.0
ray_strata_time_to_first_token_seconds_count{{{W2},endpoint="completions"}} 2.0
"""


def _parse(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_vllm_families_sum_and_reduce_the_node_series() -> None:
    got = _parse(vllm_metrics(NODE_TEXT, 'my "model"'))  # parses: valid exposition text, the label escaped
    model = (("model_name", 'my "model"'),)
    assert got[("vllm:num_requests_running", model)] == 5.0  # decode replicas summed; prefill's running is not
    assert got[("vllm:num_requests_waiting", model)] == 4.0
    assert got[("vllm:kv_cache_usage_perc", model)] == 0.5 == got[("vllm:gpu_cache_usage_perc", model)]
    assert got[("vllm:prompt_tokens_total", model)] == 150.0 == got[("vllm:prefix_cache_queries_total", model)]
    assert got[("vllm:prefix_cache_hits_total", model)] == 32.0
    assert got[("vllm:generation_tokens_total", model)] == 42.0
    assert got[("vllm:time_to_first_token_seconds_bucket", (("le", "0.1"), *model))] == 3.0
    assert got[("vllm:time_to_first_token_seconds_bucket", (("le", "+Inf"), *model))] == 5.0
    assert got[("vllm:time_to_first_token_seconds_count", model)] == 5.0
    assert got[("vllm:time_to_first_token_seconds_sum", model)] == pytest.approx(1.6)
    assert not any(name.startswith("vllm:e2e_request_latency") for name, _ in got)  # nothing observed: no family


def test_a_node_with_no_strata_series_yet_reads_zeros() -> None:
    got = _parse(vllm_metrics("", "m"))
    assert got[("vllm:num_requests_running", (("model_name", "m"),))] == 0.0
    assert got[("vllm:generation_tokens_total", (("model_name", "m"),))] == 0.0

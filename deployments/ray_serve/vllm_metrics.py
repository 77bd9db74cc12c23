"""vLLM's metric names beside Strata's, so a dashboard built for vLLM reads a Strata server unchanged.

Strata records its own metrics (``strata_*``, which Ray exports as ``ray_strata_*``). ``/metrics`` appends,
labelled with the served model's name, the vLLM families such dashboards query, each computed from Strata's
series over every process of the node:

* ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``: requests decoding in an engine (the
  aggregated LLM stage or Decode), and waiting for one (LLM or Prefill);
* ``vllm:kv_cache_usage_perc`` (and its name before vLLM 0.10, ``vllm:gpu_cache_usage_perc``): the fullest
  engine's share of device KV blocks in use, 0..1 as in vLLM;
* ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:prefix_cache_queries_total``,
  ``vllm:prefix_cache_hits_total``;
* the histograms ``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``,
  ``vllm:inter_token_latency_seconds`` (and its older name ``vllm:time_per_output_token_seconds``), with
  Strata's buckets (``histogram_quantile`` reads any).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

Labels = dict[str, str]
Pick = Callable[[Labels], bool]

GAUGES: list[tuple[str, str, str, Pick, Callable[[list[float]], float]]] = [
    ("vllm:num_requests_running", "Requests decoding in an engine", "ray_strata_engine_requests",
     lambda l: l.get("state") == "running" and l.get("stage") in ("llm", "decode"), sum),
    ("vllm:num_requests_waiting", "Requests waiting for an engine", "ray_strata_engine_requests",
     lambda l: l.get("state") == "waiting" and l.get("stage") in ("llm", "prefill"), sum),
    ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", "ray_strata_kv_cache_usage",
     lambda l: l.get("stage") in ("llm", "decode"), lambda v: max(v, default=0.0)),
    ("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full; vLLM's name before 0.10)", "ray_strata_kv_cache_usage",
     lambda l: l.get("stage") in ("llm", "decode"), lambda v: max(v, default=0.0)),
]
COUNTERS: list[tuple[str, str, str, Pick]] = [
    ("vllm:prompt_tokens_total", "Prompt tokens processed", "ray_strata_prefix_cache_tokens_total",
     lambda l: l.get("kind") == "queried"),
    ("vllm:generation_tokens_total", "Tokens generated", "ray_strata_generation_tokens_total", lambda l: True),
    ("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache",
     "ray_strata_prefix_cache_tokens_total", lambda l: l.get("kind") == "queried"),
    ("vllm:prefix_cache_hits_total", "Prompt tokens served from the prefix cache",
     "ray_strata_prefix_cache_tokens_total", lambda l: l.get("kind") == "hit"),
]
HISTOGRAMS: list[tuple[str, str, str]] = [
    ("vllm:time_to_first_token_seconds", "Time to first token", "ray_strata_time_to_first_token_seconds"),
    ("vllm:e2e_request_latency_seconds", "End-to-end request latency", "ray_strata_e2e_request_latency_seconds"),
    ("vllm:inter_token_latency_seconds", "Gap between streamed tokens", "ray_strata_inter_token_latency_seconds"),
    ("vllm:time_per_output_token_seconds", "Gap between streamed tokens (vLLM's older name)",
     "ray_strata_inter_token_latency_seconds"),
]


def vllm_metrics(node_text: str, model_name: str) -> str:
    """The vLLM families computed from a node's Prometheus text (``text/plain; version=0.0.4``)."""
    samples: dict[str, list[tuple[Labels, float]]] = defaultdict(list)
    for family in text_string_to_metric_families(node_text):
        for sample in family.samples:
            samples[sample.name].append((dict(sample.labels), float(sample.value)))
    model = _label(model_name)
    out: list[str] = []
    for name, doc, source, pick, reduce in GAUGES:
        value = reduce([v for labels, v in samples.get(source, []) if pick(labels)])
        out += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f'{name}{{model_name="{model}"}} {value}']
    for name, doc, source, pick in COUNTERS:
        value = sum(v for labels, v in samples.get(source, []) if pick(labels))
        family = name.removesuffix("_total")
        out += [f"# HELP {family} {doc}", f"# TYPE {family} counter", f'{name}{{model_name="{model}"}} {value}']
    for name, doc, source in HISTOGRAMS:
        buckets: dict[float, float] = defaultdict(float)
        for labels, v in samples.get(source + "_bucket", []):
            buckets[float(labels["le"])] += v
        if not buckets:
            continue  # nothing observed yet on this node: no bounds to show
        out += [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
        for le in sorted(buckets):
            bound = "+Inf" if le == float("inf") else repr(le)
            out.append(f'{name}_bucket{{le="{bound}",model_name="{model}"}} {buckets[le]}')
        for suffix in ("_sum", "_count"):
            total = sum(v for _, v in samples.get(source + suffix, []))
            out.append(f'{name}{suffix}{{model_name="{model}"}} {total}')
    return "\n".join(out) + "\n"


def _label(value: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

"""`strata bench serve`'s report on made-up results with known answers: throughput, TPOT, goodput."""

from __future__ import annotations

import pytest

from strata.loadtest.bench import Result, parse_goodput, summarize

pytestmark = pytest.mark.unit


def _r(ttft: float, e2el: float, out: int, prompt: int = 10) -> Result:
    return Result(ok=True, ttft=ttft, e2el=e2el, output_tokens=out, prompt_tokens=prompt, itls=[0.01] * max(0, out - 1))


def test_goodput_counts_exactly_the_requests_within_every_slo() -> None:
    results = [
        _r(0.100, 1.100, 11),  # ttft 100 ms, tpot 100 ms: good
        _r(0.300, 1.300, 11),  # ttft 300 ms: too slow to start
        _r(0.100, 3.100, 11),  # tpot 300 ms: too slow per token
        _r(0.050, 0.550, 11),  # good
        Result(ok=False, error="HTTP 500"),  # failed requests are never good
    ]
    s = summarize(results, duration=2.0, slos=parse_goodput(["ttft:200", "tpot:150"]))
    assert s["completed"] == 4 and s["failed"] == 1 and s["errors"] == ["HTTP 500"]
    assert s["goodput"] == pytest.approx(2 / 2.0)
    assert s["request_throughput"] == pytest.approx(4 / 2.0)
    assert s["output_throughput"] == pytest.approx(44 / 2.0)
    assert s["total_token_throughput"] == pytest.approx((44 + 40) / 2.0)
    assert s["median_tpot_ms"] == pytest.approx(100.0)  # (e2el - ttft) / (output - 1), per request


def test_without_slos_there_is_no_goodput_and_bad_specs_are_refused() -> None:
    assert summarize([_r(0.1, 0.2, 2)], 1.0, {})["goodput"] is None
    with pytest.raises(ValueError, match="ttft:MS"):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError):
        parse_goodput(["ttft:"])

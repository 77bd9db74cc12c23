"""The aggregated LLM replica's engine core in a process of its own, under a real `strata serve`: it runs
on every core, and killing it mid-stream ends that stream with one in-band error, after which Serve
replaces the replica and the same request gets the same answer. (The child in isolation:
test_engine_process.)"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import httpx
import psutil

from helpers import MODEL_NAME, wait_until

LEAKS = ("pid", "/tmp", "Actor", "Traceback", "engine_process")


def _chat(content: str, **extra: Any) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def _llm_replicas(server) -> list[int]:
    apps = httpx.get(server.dashboard_url + "/api/serve/applications/", timeout=30).json()["applications"]
    return [r["pid"] for r in apps["strata"]["deployments"]["LLM"]["replicas"] if r["state"] == "RUNNING"]


def _engine_children(replica: int) -> list[psutil.Process]:
    return [c for c in psutil.Process(replica).children(recursive=True)
            if "strata.stages.engine_process" in " ".join(c.cmdline())]


def _wait(condition, timeout: float, what: str) -> Any:
    return wait_until(condition, timeout, what, (httpx.HTTPError, KeyError, psutil.Error))


def _answer(server) -> str:
    r = httpx.post(server.base_url + "/v1/chat/completions", json=_chat("A short tale of the sea.", max_tokens=12),
                   timeout=60)
    return r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else ""


def test_the_engine_runs_in_a_child_of_the_replica_on_every_core(aggregated_server) -> None:
    (replica,) = _llm_replicas(aggregated_server)
    assert len(_engine_children(replica)) == 1
    stats = httpx.get(aggregated_server.base_url + "/strata/stats", timeout=30).json()
    assert stats["decode"]["tp"] == 1 and stats["decode"]["threads"] == len(os.sched_getaffinity(0))


def test_killing_the_engine_mid_stream_is_an_error_event_then_the_replica_is_replaced(aggregated_server) -> None:
    expected = _answer(aggregated_server)
    assert expected
    (replica,) = _llm_replicas(aggregated_server)
    (child,) = _engine_children(replica)
    body = _chat("Tell me an endless story about lanterns and tides.", max_tokens=1800, ignore_eos=True, stream=True)
    with httpx.stream("POST", aggregated_server.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += bool(line.strip())
            if seen >= 5:
                break
        t0 = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        rest = [line for line in lines if line.strip()]
    assert time.monotonic() - t0 < 30, "the stream must end at once, not at its deadline"
    assert rest[-1] == "data: [DONE]"
    assert '"error"' in rest[-2] and "server_error" in rest[-2]
    assert not any(leak in rest[-2] for leak in LEAKS), rest[-2]
    # the replica's health check fails; Serve starts another, whose engine child answers as before
    _wait(lambda: [p for p in _llm_replicas(aggregated_server) if p != replica], 180, "a new LLM replica")
    assert _wait(lambda: _answer(aggregated_server), 120, "an answer from the new replica") == expected

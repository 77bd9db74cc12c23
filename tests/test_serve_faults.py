"""Faults against a real disaggregated server of its own: overload, stalled uploads, killed replicas, a killed
HAProxy, disconnects during prefill, tier files deleted under load, a poisoned request in a batch, and
tensor-parallel ranks that fail mid-step.

Every failure reaches its client (a JSON 4xx/5xx, or an in-band error then ``[DONE]``) without
internals, the server serves correctly afterwards, and no KV block or host-tier pin leaks.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from helpers import MODEL_NAME, metric_value, scrape_metrics, wait_until

pytestmark = pytest.mark.serve

# Prefill admits 3 calls at a time (2 running + 1 queued) so that 12 requests at once overflow it
# (one running slot stays free for /strata/stats while a prompt prefills), and prefills in 16-token
# chunks so that a long prompt stays in prefill long enough to be interrupted.
# The ingress admits 12 requests (8 + 4 queued) and gives a body 3 s to arrive: 20 stalled uploads
# would lock everyone out if they counted as admitted, and are cut off quickly when they do not.
FAULT_CONFIG = {
    "mode": "disaggregated",
    "engine": {"max_model_len": 8192, "prefill_chunk_tokens": 16, "host_kv_blocks": 4096},
    "request_body_timeout_s": 3,
    "stages": {"prefill": {"min_replicas": 1, "max_replicas": 1, "max_ongoing_requests": 2, "max_queued_requests": 1},
               "ingress": {"max_ongoing_requests": 8, "max_queued_requests": 4},
               "decode": {"tp": 2}},  # decode is a tensor-parallel group: killing either rank is a fault too
}
LEAKS = ("pid", "actor", "ip=", "/tmp/", "Traceback", "ActorDied", "RayTaskError")


@pytest.fixture(scope="module")
def server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from serve_process import ServeProcess

    workdir = tmp_path_factory.mktemp("serve-faults")
    config = {**FAULT_CONFIG, "engine": {**FAULT_CONFIG["engine"], "host_kv_dir": str(workdir / "host")}}
    faults = workdir / "faults"  # files here make a rank fail at a named point (pipeline.fault_points)
    faults.mkdir()
    # prompts of 1,500 words need more than the tiny model's 4,096 positions (random weights extrapolate fine)
    proc = ServeProcess(llama_dir, workdir, config, env={"STRATA_FAULT_DIR": str(faults),
                                                         "STRATA_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    try:
        proc.wait_ready()
        proc.host_dir = workdir / "host"
        proc.faults = faults
        yield proc
    finally:
        proc.stop()
    # even after the faults above, Ctrl-C is a clean stop
    assert proc.shutdown_errors() == [], proc.shutdown_errors()


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **extra}


def _post(server, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=timeout)


def _post_retrying(server, body: dict[str, Any], attempts: int = 20) -> httpx.Response:
    """As a well-behaved client does (the openai client among them): a 429 is retried after a pause."""
    for _ in range(attempts):
        r = _post(server, body)
        if r.status_code != 429:
            return r
        time.sleep(0.5)
    return r


def _stats(server) -> dict[str, Any]:
    return httpx.get(server.base_url + "/strata/stats", timeout=30).json()


def _pins(server) -> int:
    with sqlite3.connect(server.host_dir / "index.db", timeout=30) as db:
        return int(db.execute("SELECT COUNT(*) FROM pins").fetchone()[0])


def _replica_pids(server, deployment: str) -> list[int]:
    apps = httpx.get(server.dashboard_url + "/api/serve/applications/", timeout=30).json()["applications"]
    return [r["pid"] for r in apps["strata"]["deployments"][deployment]["replicas"] if r["state"] == "RUNNING"]


def _wait(condition, timeout: float, what: str) -> Any:
    return wait_until(condition, timeout, what, (httpx.HTTPError, KeyError))  # a stage being replaced may not answer


def _baseline(server) -> dict[str, int]:
    s = _stats(server)
    return {stage: s[stage]["kv"]["device"]["in_use"] for stage in ("prefill", "decode")}


def _settled(server, baseline: dict[str, int], timeout: float = 60) -> None:
    """Queued prompt tokens 0, device blocks back to ``baseline``, no host-tier pins: nothing leaked."""
    def clean() -> bool:
        s = _stats(server)
        return (s["prefill"]["queued_prompt_tokens"] == 0 and s["decode"]["running"] == 0
                and _baseline(server) == baseline and _pins(server) == 0)

    _wait(clean, timeout, f"no leaks (stats {_stats(server)}, pins {_pins(server)})")


def _long_prompt(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["harbour", "storm", "lantern", "keel", "gull", "tide", "rope", "sail"]) for _ in range(n_words))


def test_overload_is_only_200s_and_429s(server) -> None:
    prompt = _long_prompt(400, 1)

    def one(i: int) -> httpx.Response:
        return _post(server, _chat(f"{i} {prompt}", stream=i % 2 == 0))

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(one, range(12)))
    statuses = sorted(r.status_code for r in answers)
    assert set(statuses) <= {200, 429}, statuses
    assert 200 in statuses and 429 in statuses, statuses
    for r in answers:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
    assert _post(server, _chat("after the storm")).status_code == 200


def test_disconnect_during_prefill_frees_everything(server) -> None:
    baseline = _baseline(server)
    body = json.dumps(_chat(_long_prompt(1500, 2), stream=True)).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n\r\n".encode() + body)
        # part-way through its chunks (a loaded machine may take a moment to start them)
        _wait(lambda: 0 < _stats(server)["prefill"]["queued_prompt_tokens"] < 6000, 60, "the prompt to be mid-prefill")
    # the client hung up mid-prefill: the prompt's chunks stop, its blocks and pins are released
    _settled(server, baseline)


def _first_lines(lines: Iterator[str], n: int) -> list[str]:
    out = []
    for line in lines:
        if line.strip():
            out.append(line)
        if len(out) >= n:
            break
    return out


def _kill_mid_stream(server, pid: int, seed: int) -> None:
    """Kill ``pid`` five events into a long stream: the stream must end with one in-band error event
    without internals, then ``[DONE]``."""
    body = _chat(_long_prompt(50, seed), max_tokens=4000, ignore_eos=True, stream=True)
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # one iterator: the stream can be read once
        _first_lines(lines, 5)
        os.kill(pid, signal.SIGKILL)
        rest = [line for line in lines if line.strip()]
    assert rest[-1] == "data: [DONE]"
    assert '"error"' in rest[-2] and "server_error" in rest[-2]
    assert not any(leak in rest[-2] for leak in LEAKS), rest[-2]


def _answer_after_restart(server) -> str:
    again = _wait(lambda: (r := _post(server, _chat("A short tale of the sea.", max_tokens=12))).status_code == 200 and r,
                  60, "a successful request after the restart")
    return again.json()["choices"][0]["message"]["content"]


def test_killing_the_decode_replica_mid_stream_is_an_error_event_then_service_resumes(server) -> None:
    expected = _post(server, _chat("A short tale of the sea.", max_tokens=12)).json()["choices"][0]["message"]["content"]
    baseline = _baseline(server)
    failed_before = metric_value(scrape_metrics(server.metrics_url), "ray_strata_requests_total", endpoint="chat",
                                 status="500")
    (pid,) = _replica_pids(server, "Decode")
    _kill_mid_stream(server, pid, seed=3)
    _wait(lambda: [p for p in _replica_pids(server, "Decode") if p != pid], 120, "a new Decode replica")
    assert _answer_after_restart(server) == expected
    _settled(server, {**baseline, "decode": 0})
    # the metrics count the killed stream as a failed (500) chat request, not as a success or a cancel
    _wait(lambda: metric_value(scrape_metrics(server.metrics_url), "ray_strata_requests_total", endpoint="chat",
                               status="500") == failed_before + 1, 30, "the failed stream in the metrics")


def _tp_worker_pids(server) -> list[int]:
    params = {"filter_keys": "class_name", "filter_predicates": "=", "filter_values": "TPWorker", "limit": 100}
    body = httpx.get(server.dashboard_url + "/api/v0/actors", params=params, timeout=30).json()
    return [a["pid"] for a in body["data"]["result"]["result"] if a["state"] == "ALIVE"]


def test_killing_a_tensor_parallel_decode_worker_fails_its_streams_then_the_group_is_replaced(server) -> None:
    expected = _post(server, _chat("A short tale of the sea.", max_tokens=12)).json()["choices"][0]["message"]["content"]
    (replica,) = _replica_pids(server, "Decode")
    (worker,) = _wait(lambda: _tp_worker_pids(server), 60, "the decode replica's rank-1 worker")
    _kill_mid_stream(server, worker, seed=6)
    # the replica's health check fails, and Serve replaces the whole group (replica and worker)
    _wait(lambda: [p for p in _replica_pids(server, "Decode") if p != replica], 120, "a new Decode replica")
    _wait(lambda: [p for p in _tp_worker_pids(server) if p != worker], 120, "a new rank-1 worker")
    assert _answer_after_restart(server) == expected


def test_killing_the_prefill_replica_mid_prefill_is_a_json_500_then_service_resumes(server) -> None:
    (pid,) = _replica_pids(server, "Prefill")
    answer: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: answer.setdefault("r", _post(server, _chat(_long_prompt(1500, 4)))))
    t.start()
    _wait(lambda: _stats(server)["prefill"]["queued_prompt_tokens"] > 0, 60, "the prompt to be in prefill")
    os.kill(pid, signal.SIGKILL)
    t.join(timeout=120)
    r = answer["r"]
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == "server_error" and not any(leak in err["message"] for leak in LEAKS), err
    _wait(lambda: [p for p in _replica_pids(server, "Prefill") if p != pid], 120, "a new Prefill replica")
    _wait(lambda: _post(server, _chat("calm again")).status_code == 200, 60, "a successful request after the restart")
    _settled(server, {"prefill": 0, "decode": _baseline(server)["decode"]})


def test_tier_files_deleted_and_corrupted_under_load_never_change_an_answer(server) -> None:
    shared = _long_prompt(300, 5)
    bodies = [_chat(f"{shared} Question {i}: what comes next?") for i in range(6)]
    expected = [_post(server, b).json()["choices"][0]["message"]["content"] for b in bodies]  # clean, sequential
    stop = threading.Event()

    def vandal() -> None:
        rng = random.Random(0)
        while not stop.is_set():
            for f in list((server.host_dir / "blocks").rglob("*.kv")):
                if rng.random() < 0.5:
                    f.unlink(missing_ok=True)
                else:
                    try:
                        f.write_bytes(os.urandom(64))
                    except OSError:
                        pass
            time.sleep(0.05)

    t = threading.Thread(target=vandal, daemon=True)
    t.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda b: _post_retrying(server, b), bodies))
    finally:
        stop.set()
        t.join()
    assert [r.status_code for r in got] == [200] * len(bodies), [r.text for r in got]
    assert [r.json()["choices"][0]["message"]["content"] for r in got] == expected


def test_a_poisoned_request_in_a_batch_harms_no_other(server) -> None:
    bodies = [_chat(f"Name a colour, number {i}.") for i in range(2)]
    expected = [_post(server, b).json()["choices"][0]["message"]["content"] for b in bodies]
    poisoned = _chat("Name a colour, number 0.", temperature=1e-45, top_p=1e-45)  # valid, but at the edge of floats
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_post_retrying, server, b) for b in [poisoned, *bodies]]
        answers = [f.result() for f in futures]
    assert answers[0].status_code == 200
    assert answers[0].json()["choices"][0]["message"]["content"] == expected[0]  # behaves as greedy
    assert [a.json()["choices"][0]["message"]["content"] for a in answers[1:]] == expected


def _stream_text(server, body: dict[str, Any], after_events: int = 0, then: Any = None) -> tuple[str, list[str]]:
    """A streamed chat's text and its raw event lines; ``then()`` runs after ``after_events`` events."""
    lines_seen: list[str] = []
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.strip():
                continue
            lines_seen.append(line)
            if then is not None and len(lines_seen) == after_events:
                then()
    text = ""
    for line in lines_seen:
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                text += chunk["choices"][0]["delta"].get("content") or ""
    return text, lines_seen


@pytest.mark.parametrize("rank", [0, 1], ids=["driver", "worker"])
def test_a_tp_step_failing_on_one_rank_mid_stream_changes_no_token(server, rank: int) -> None:
    """A fault in one rank's forward, between a layer's two all-reduces, while the decode group streams:
    the group abandons that step together and retries it, so the stream is exactly the unfaulted one. The
    fault is armed at the stream's third event, and the stream is long enough (~1-3 s of steps here) that a
    client slowed by a busy host still arms it well before the last step."""
    body = _chat(_long_prompt(40, 7), max_tokens=320, ignore_eos=True, stream=True)
    expected, _ = _stream_text(server, body)
    armed = server.faults / f"tp_layer.rank{rank}"
    got, lines = _stream_text(server, body, after_events=3, then=lambda: armed.write_text("1"))
    assert not armed.exists(), "the fault fired inside the stream"
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    assert got == expected


def test_a_tp_worker_whose_loop_raises_fails_its_stream_at_once_then_the_group_is_replaced(server) -> None:
    """The worker's command loop raises (its Ray actor lives on): its gone mark fails the driver's next
    collective at once - an in-band error within seconds, not the 60 s collective timeout - and the
    health check has Serve replace the group."""
    expected = _post(server, _chat("A short tale of the sea.", max_tokens=12)).json()["choices"][0]["message"]["content"]
    (replica,) = _replica_pids(server, "Decode")
    body = _chat(_long_prompt(50, 8), max_tokens=4000, ignore_eos=True, stream=True)
    armed: dict[str, float] = {}

    def arm() -> None:
        (server.faults / "tp_command.rank1").write_text("1")
        armed["at"] = time.monotonic()

    _, lines = _stream_text(server, body, after_events=5, then=arm)
    assert time.monotonic() - armed["at"] < 15
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and "server_error" in lines[-2]
    assert not any(leak in lines[-2] for leak in LEAKS), lines[-2]
    _wait(lambda: [p for p in _replica_pids(server, "Decode") if p != replica], 120, "a new Decode replica")
    assert _answer_after_restart(server) == expected


def _stall(base_url: str) -> socket.socket:
    """A client that sends headers and the start of a JSON body, then nothing."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                 f"content-length: 4096\r\n\r\n{{\"model\": ".encode())
    return sock


def _response_of(sock: socket.socket) -> tuple[int, str]:
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


@pytest.mark.parametrize("port", ["proxy", "direct"])
def test_stalled_uploads_lock_nobody_out_and_are_cut_off(server, port: str) -> None:
    """Twenty sockets that send headers and `{"model": ` then stall - more than the ingress admits - while a
    normal client is answered at once (a request counts only once its body arrived), and each stalled
    socket gets a JSON 408 when its body deadline passes."""
    base = server.base_url if port == "proxy" else server.direct_url
    assert base is not None, "the fast path prints a direct endpoint"
    stalled = [_stall(base) for _ in range(20)]
    try:
        time.sleep(0.5)  # every stalled request has reached the ingress
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/chat/completions", json=_chat("calm water", max_tokens=2), timeout=30)
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 2.0
        for sock in stalled:
            status, body = _response_of(sock)
            assert status == 408, body
            err = json.loads(body)["error"]
            assert "did not arrive within 3 s" in err["message"] and err["code"] == "request_timeout"
    finally:
        for sock in stalled:
            sock.close()


def _ingress_pid(server) -> int:
    """The process that listens on the server's load-balanced port: HAProxy, the default ingress."""
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == server.port and conn.pid is not None:
            return conn.pid
    raise AssertionError(f"nothing listens on port {server.port}")


def test_killing_haproxy_cuts_only_its_own_streams_then_the_port_serves_again(server) -> None:
    """HAProxy killed mid-stream: a stream through it breaks (its connection is gone) and its KV is freed;
    a stream on a replica's own port beside it finishes whole; Serve's manager restarts HAProxy and the
    load-balanced port gives the same answer as before."""
    import psutil

    expected = _post(server, _chat("A short tale of the sea.", max_tokens=12)).json()["choices"][0]["message"]["content"]
    baseline = _baseline(server)
    pid = _ingress_pid(server)
    assert psutil.Process(pid).name() == "haproxy"
    beside: dict[str, Any] = {}

    def direct_stream() -> None:
        body = _chat(_long_prompt(40, 11), max_tokens=60, ignore_eos=True, stream=True)
        with httpx.stream("POST", server.direct_url + "/v1/chat/completions", json=body, timeout=120) as r:
            beside["lines"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    other = threading.Thread(target=direct_stream)
    body = _chat(_long_prompt(50, 12), max_tokens=4000, ignore_eos=True, stream=True)
    with pytest.raises(httpx.HTTPError):
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            _first_lines(lines, 5)
            other.start()
            os.kill(pid, signal.SIGKILL)
            for _ in lines:
                pass
    other.join(timeout=120)
    events = beside["lines"]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), events[-3:]
    finishes = [c.get("finish_reason") for e in events[:-1] for c in json.loads(e[len("data: "):]).get("choices", [])]
    assert "length" in finishes, events[-3:]
    assert _answer_after_restart(server) == expected  # within 60 s: Serve restarted HAProxy
    assert _ingress_pid(server) != pid
    _settled(server, baseline)

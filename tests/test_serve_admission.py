"""Admission is exact whatever way a request ends, in both serving modes of a real server: ninety clients,
thirty at a time, go away at random points (mid-body, right after sending, after one, two or a few
streamed chunks, while waiting for a whole answer); within 5 s of the last one the front door holds no
admission slot, and a new request is admitted. (Counted in a stream generator's ``finally``, each burst
used to leave up to 12 ghost slots: a server under normal churn filled up with them and turned everyone
away with 429s.)"""

from __future__ import annotations

import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers import MODEL_NAME, wait_until

pytestmark = pytest.mark.serve
WORDS = ["harbour", "storm", "lantern", "keel", "gull", "tide", "rope", "sail"]


def _leave(server, i: int) -> None:
    """One client that goes away at a point ``i`` chooses."""
    rng = random.Random(i)
    way = i % 6
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Story {i}: {prompt}"}],
            "max_tokens": rng.randint(24, 200), "ignore_eos": True, "temperature": 0, "stream": way in (2, 3, 4)}
    raw = json.dumps(body).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    try:
        if way in (0, 1):  # a raw socket: hang up mid-body, or as soon as the request is out
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                        f"content-length: {len(raw)}\r\n\r\n").encode()
                sock.sendall(head + (raw[: len(raw) // 2] if way == 0 else raw))
                time.sleep(rng.random() * 0.3)
        elif way in (2, 3, 4):  # a stream left after its first chunk, its second, or a few more
            with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
                wanted, seen = (way - 1) if way < 4 else rng.randint(3, 8), 0
                for line in r.iter_lines():
                    seen += bool(line.strip())
                    if seen >= wanted:
                        break
        else:  # a whole answer the client stops waiting for
            httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=rng.uniform(0.05, 0.6))
    except httpx.HTTPError:
        pass


def _held(server) -> int:
    return httpx.get(server.base_url + "/strata/stats", timeout=30).json()["ingress"]["ongoing_requests"]


def test_clients_leaving_at_any_point_leave_no_admission_slot_behind(any_server) -> None:
    with ThreadPoolExecutor(30) as pool:
        for burst in range(3):
            list(pool.map(lambda i: _leave(any_server, i), range(30 * burst, 30 * burst + 30)))
    wait_until(lambda: _held(any_server) == 0, 5, "no admission slot held", (httpx.HTTPError,))
    after = httpx.post(any_server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "after the crowd left"}], "max_tokens": 4})
    assert after.status_code == 200

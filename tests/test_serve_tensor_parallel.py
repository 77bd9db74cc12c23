"""`strata serve` with a tensor-parallel decode stage: the shared disaggregated server's config says
``"decode": {"tp": 2}``, so every disaggregated test of the openai client (test_serve_api: text and
image, streamed and whole, sampling parameters) is answered through a group of two. Here: the
replica really is that group. (Killing either rank: test_serve_faults.)"""

from __future__ import annotations

import httpx


def test_the_decode_replica_is_a_group_of_two(serve_server) -> None:
    params = {"filter_keys": "class_name", "filter_predicates": "=", "filter_values": "TPWorker", "limit": 100}
    body = httpx.get(serve_server.dashboard_url + "/api/v0/actors", params=params, timeout=30).json()
    alive = [a for a in body["data"]["result"]["result"] if a["state"] == "ALIVE"]
    assert len(alive) == 1  # rank 1 of the one decode replica (rank 0 is the replica itself)
    stats = httpx.get(serve_server.base_url + "/strata/stats", timeout=30).json()
    assert stats["decode"]["tp"] == 2

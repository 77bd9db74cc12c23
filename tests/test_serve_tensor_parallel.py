"""`strata serve` with a tensor-parallel stage: the shared disaggregated server's config says
``"decode": {"tp": 2}``, so every test of the openai client against it (test_serve_api: text and
image, streamed and whole, sampling parameters; the bad-input corpus) is answered through a group of
two. Here: the replica really is that group, and its cores are split between the ranks. (Killing
either rank of a decode group: test_serve_faults.)"""

from __future__ import annotations

import os

import httpx

CORES = len(os.sched_getaffinity(0))  # the servers run on this machine


def _workers(server) -> list[dict]:
    params = {"filter_keys": "class_name", "filter_predicates": "=", "filter_values": "TPWorker", "limit": 100}
    body = httpx.get(server.dashboard_url + "/api/v0/actors", params=params, timeout=30).json()
    return [a for a in body["data"]["result"]["result"] if a["state"] == "ALIVE"]


def test_the_decode_replica_is_a_group_of_two(serve_server) -> None:
    assert len(_workers(serve_server)) == 1  # rank 1 of the one decode replica (rank 0 is the replica itself)
    stats = httpx.get(serve_server.base_url + "/strata/stats", timeout=30).json()
    assert stats["decode"]["tp"] == 2
    # Ray gives replicas that reserve no CPUs OMP_NUM_THREADS=1; the model still gets every core,
    # split between the ranks of a group
    assert stats["decode"]["threads"] == max(1, CORES // 2) and stats["prefill"]["threads"] == CORES

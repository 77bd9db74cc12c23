"""`strata serve` with a tensor-parallel decode stage (the shared disaggregated server's config says
``"decode": {"tp": 2}``): the replica really is a group of two, and the openai client gets the
one-process engine's tokens through it, streamed and not, with an image."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import openai
import pytest

from helpers import build, greedy


def _workers(server) -> list[dict]:
    url = server.dashboard_url + "/api/v0/actors"
    params = {"filter_keys": "class_name", "filter_predicates": "=", "filter_values": "TPWorker", "limit": 100}
    body = httpx.get(url, params=params, timeout=30).json()
    return [a for a in body["data"]["result"]["result"] if a["state"] == "ALIVE"]


def test_the_decode_replica_is_a_group_of_two(serve_server) -> None:
    workers = _workers(serve_server)
    assert len(workers) == 1  # rank 1 of the one decode replica (rank 0 is the replica itself)


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_client_gets_the_engine_tokens_through_a_tp2_decode(serve_server, llama_dir: Path, demo_images,
                                                                        stream: bool) -> None:
    client = openai.OpenAI(base_url=serve_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    url = "data:image/png;base64," + base64.b64encode(demo_images[0]).decode()
    content = [{"type": "text", "text": "Describe the picture at length."}, {"type": "image_url", "image_url": {"url": url}}]
    messages = [{"role": "user", "content": content}]
    expected = "".join(build(llama_dir, max_model_len=2048).stream(
        messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the picture at length."}]}],
        images=demo_images[:1], params=greedy(24)))
    if stream:
        chunks = client.chat.completions.create(model="strata-test", messages=messages, max_tokens=24, temperature=0,
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = client.chat.completions.create(model="strata-test", messages=messages, max_tokens=24,
                                              temperature=0).choices[0].message.content
    assert text == expected

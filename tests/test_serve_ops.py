"""Operating the real server: errors are OpenAI-style 4xx, disconnects free KV, stages autoscale,
and everything listens on loopback only."""

from __future__ import annotations

import base64
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image

MODEL = "strata-test"


def _chat(content, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def _image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def _big_png() -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((400, 400), 64).convert("RGB").save(buf, format="PNG")  # incompressible: > 200 KB
    return buf.getvalue()


ERRORS = [
    ("malformed-json", b"{not json", 400, None),
    ("not-an-object", b"[1, 2]", 400, None),
    ("missing-messages", json.dumps({"model": MODEL}).encode(), 400, None),
    ("bad-role", json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode(), 400, None),
    ("negative-max-tokens", json.dumps(_chat("hi", max_tokens=-3)).encode(), 400, None),
    ("n-greater-than-one", json.dumps(_chat("hi", n=2)).encode(), 400, None),
    ("remote-image-url", json.dumps(_chat([{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}])).encode(), 400, None),
    ("bad-base64", json.dumps(_chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}])).encode(), 400, None),
    ("undecodable-image", json.dumps(_chat([_image_part(b"definitely not an image")])).encode(), 400, None),
    ("oversized-image", json.dumps(_chat([_image_part(_big_png())])).encode(), 400, None),
    ("prompt-too-long", json.dumps(_chat("word " * 3000)).encode(), 400, "context_length_exceeded"),
    ("unknown-model", json.dumps({**_chat("hi"), "model": "gpt-9"}).encode(), 404, "model_not_found"),
]


@pytest.mark.parametrize("body, status, code", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_requests_get_openai_error_bodies(serve_server, body: bytes, status: int, code) -> None:
    r = httpx.post(serve_server.base_url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if code:
        assert err["code"] == code
    # and the server keeps serving
    ok = httpx.post(serve_server.base_url + "/v1/chat/completions", json=_chat("still there?"), timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None


def _stats(server) -> dict:
    return httpx.get(server.base_url + "/strata/stats", timeout=30).json()


def test_disconnect_mid_stream_returns_blocks_to_baseline(serve_server) -> None:
    before = _stats(serve_server)
    body = _chat("Tell me an endless story about the sea. " * 8, max_tokens=1500, ignore_eos=True, stream=True)
    with httpx.stream("POST", serve_server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines, it = 0, r.iter_lines()  # keep the iterator: dropping it closes the connection
        for line in it:
            lines += bool(line.strip())
            if lines >= 5:
                break
        during = _stats(serve_server)
        assert during["decode"]["running"] == 1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = _stats(serve_server)
        if after["decode"]["running"] == 0 and all(
            after[s]["kv"]["device"]["in_use"] == before[s]["kv"]["device"]["in_use"] for s in ("prefill", "decode")
        ):
            break
        time.sleep(0.2)
    assert after["decode"]["running"] == 0, after
    for stage in ("prefill", "decode"):
        assert after[stage]["kv"]["device"]["in_use"] == before[stage]["kv"]["device"]["in_use"], (stage, after)
    assert after[stage]["kv"]["spilled_blocks"] == 0


def _replicas(server, deployment: str) -> int:
    apps = httpx.get(server.dashboard_url + "/api/serve/applications/", timeout=30).json()["applications"]
    replicas = apps["strata"]["deployments"][deployment]["replicas"]
    return sum(r["state"] == "RUNNING" for r in replicas)


def test_every_stage_deployment_is_healthy_in_the_dashboard(serve_server) -> None:
    apps = httpx.get(serve_server.dashboard_url + "/api/serve/applications/", timeout=30).json()["applications"]
    deployments = apps["strata"]["deployments"]
    assert set(deployments) == {"Ingress", "Preprocess", "Encode", "Prefill", "Decode"}
    assert all(d["status"] in ("HEALTHY", "UPSCALING", "DOWNSCALING") for d in deployments.values()), deployments


def test_a_burst_scales_prefill_up_and_idleness_scales_it_down(serve_server) -> None:
    assert _replicas(serve_server, "Prefill") == 1
    prompt = "Summarize the ship's log: " + " ".join(f"day {i} calm seas" for i in range(150))

    def one(i: int) -> int:
        body = _chat(f"{i} {prompt}", max_tokens=2)
        return httpx.post(serve_server.base_url + "/v1/chat/completions", json=body, timeout=300).status_code

    peak = 1
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(48)]
        while not all(f.done() for f in futures):
            peak = max(peak, _replicas(serve_server, "Prefill"))
            time.sleep(0.5)
        assert all(f.result() == 200 for f in futures)
    deadline = time.monotonic() + 30
    while peak < 2 and time.monotonic() < deadline:  # the scale-up may land just after the burst
        peak = max(peak, _replicas(serve_server, "Prefill"))
        time.sleep(0.5)
    assert peak == 2, "the queued prompt tokens should have asked for a second prefill replica"
    deadline = time.monotonic() + 60
    while _replicas(serve_server, "Prefill") > 1 and time.monotonic() < deadline:
        time.sleep(1)
    assert _replicas(serve_server, "Prefill") == 1, "an idle prefill stage should shrink back"


def test_the_server_listens_on_loopback_only(serve_server) -> None:
    new = serve_server.sockets_before
    from serve_process import listening_sockets

    opened = [addr for addr, proc in listening_sockets() - new if ("ray" in proc or "python" in proc or "raylet" in proc
                                                                 or "gcs_server" in proc or "strata" in proc)]
    assert opened, "expected the server's sockets to show up"
    exposed = [a for a in opened if not (a.startswith("127.0.0.1:") or a.startswith("[::ffff:127.0.0.1]:") or a.startswith("[::1]:"))]
    assert not exposed, exposed

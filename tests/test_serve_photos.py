"""Photos on the default path (aggregated, Ray Serve's fast path) of a real Qwen2.5-VL server: a 12-megapixel
photo at the processor's default settings, a 1024x1024 image asked at a million pixels (its pixel tensor is
over gRPC's 4 MiB cap, which made it a 500), and eight images at the per-request limit, each answered with
the prompt count the in-process engine gives; two tiny PNGs asked to become 16.7 M pixels each are refused
as too long for the context from their headers, fast, without the Preprocess replica growing."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import psutil
import pytest
from PIL import Image

from helpers import MODEL_NAME, build, greedy

pytestmark = pytest.mark.serve
PROMPT = "What is in the picture?"


def _photo(width: int, height: int, seed: int = 0) -> bytes:
    """A photo-like JPEG: smooth gradients with sensor-like noise (a 12 MP one is ~7 MB)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 // width, yy * 255 // height, (xx + yy) * 255 // (width + height)], -1)
    pixels = np.clip(base + rng.integers(-24, 24, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def _noise_png(side: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def _tiny_png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 40, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def qwen(qwen_vl_server):
    return qwen_vl_server


def _ask(server, images: list[bytes], kwargs: dict | None = None) -> httpx.Response:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(b).decode()}}
             for b in images]
    body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}]}
    if kwargs:
        body["mm_processor_kwargs"] = kwargs
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)


def _preprocess_rss(server) -> int:
    apps = httpx.get(server.dashboard_url + "/api/serve/applications/", timeout=30).json()["applications"]
    (pid,) = [r["pid"] for r in apps["strata"]["deployments"]["Preprocess"]["replicas"] if r["state"] == "RUNNING"]
    return psutil.Process(pid).memory_info().rss


def test_photos_of_any_size_are_served_on_the_default_path(qwen) -> None:
    engine = build(qwen.model, max_model_len=4096)
    cases = [([_photo(4032, 3024)], None), ([_noise_png(1024)], {"max_pixels": 1 << 20}),
             ([_photo(1024, 1024, seed) for seed in range(8)], {"max_pixels": 1 << 18})]
    pixels = []
    for images, kwargs in cases:
        r = _ask(qwen, images, kwargs)
        assert r.status_code == 200, r.text[:300]
        expected = engine.generate([{"prompt": PROMPT, "images": images, "params": greedy(4),
                                     "mm_processor_kwargs": kwargs}])[0]
        assert r.json()["usage"]["prompt_tokens"] == expected.num_prompt_tokens
        assert r.json()["choices"][0]["message"]["content"] == expected.text
        # the front door's trace of it: what each hop carried (``bench flow`` reports these)
        flows = httpx.get(qwen.base_url + "/strata/stats", timeout=30).json()["ingress"]["flows"]
        hops = {h["name"]: h for h in next(f for f in flows if f["request_id"] == r.json()["id"])["hops"]}
        assert hops["preprocess"]["sent"] == sum(len(b) for b in images)
        assert hops["encode"]["sent"] == hops["preprocess"]["received"]
        assert hops["engine"]["sent"] >= hops["encode"]["received"] > 0
        pixels.append(hops["preprocess"]["received"])
    assert len(cases[0][0][0]) > 4 << 20 and min(pixels[1:]) > 4 << 20  # the photo's bytes, the others' pixels: over
    # gRPC's cap, which made them 500s


def test_a_prompt_too_long_for_its_images_is_refused_before_a_pixel(qwen) -> None:
    before = _preprocess_rss(qwen)
    start = time.monotonic()
    r = _ask(qwen, [_tiny_png(), _tiny_png()], {"min_pixels": 4096 * 4096, "max_pixels": 4096 * 4096})
    assert time.monotonic() - start < 5
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert "of them for images" in r.json()["error"]["message"]
    assert _preprocess_rss(qwen) - before < 100 << 20

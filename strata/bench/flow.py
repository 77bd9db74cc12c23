"""`strata bench flow`: the whole request flow of a real server, traced hop by hop.

A real `strata serve` of the bench's small Qwen2.5-VL (``bench vision``'s; ``--model tiny`` for a smoke run)
in each serving mode (aggregated: Preprocess, Encode, the LLM replica's engine process; disaggregated:
Preprocess, Encode, Prefill, Decode with the KV through the host tier) answers the same requests: text
only, one image at three sizes (a 12-megapixel photo at the processor's default settings among them), and
eight images. For each request the front door's trace (``/strata/stats`` ``ingress.flows``) gives every
hop's bytes each way and its time, and the KV the prompt left in the host tier; the client's end-to-end
time is beside them. What an image, or a long prompt, costs each hop, measured where it is sent.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

REQUESTS = (("text", [], None), ("640x480", ["640x480"], None), ("1024x1024 at 1 MP", ["1024x1024"], {"max_pixels": 1 << 20}),
            ("12 MP photo", ["4032x3024"], None), ("8 x 1024x768", ["1024x768"] * 8, {"max_pixels": 1 << 18}))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("small", "tiny"), default="small")
    p.add_argument("--modes", nargs="+", default=["aggregated", "disaggregated"])
    p.add_argument("--json", type=Path)


def _photo(size: str, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    width, height = (int(v) for v in size.split("x"))
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([xx * 255 // width, yy * 255 // height, (xx + yy) * 255 // (width + height)], -1)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(base + rng.integers(-24, 24, base.shape), 0, 255).astype(np.uint8)).save(
        buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def _body(images: list[bytes], kwargs: dict[str, Any] | None) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(b).decode()}}
             for b in images]
    body: dict[str, Any] = {"model": "strata-bench", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe it."}]}]}
    if kwargs:
        body["mm_processor_kwargs"] = kwargs
    return body


def _run_mode(model: Path, mode: str) -> list[dict[str, Any]]:
    import httpx

    from strata.local_server import LocalServer

    work = Path(tempfile.mkdtemp(prefix=f"strata-flow-{mode}-"))
    config = {"mode": mode, "engine": {"max_model_len": 8192, "host_kv_blocks": 2048,
                                       "host_kv_dir": str(work / "host")}}
    server = LocalServer(model, work, config, model_name="strata-bench",
                         env={"RAY_AUTH_MODE": "disabled", "STRATA_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    rows = []
    try:
        server.wait_ready(600)
        for seed, (label, sizes, kwargs) in enumerate(REQUESTS):
            images = [_photo(size, seed * 10 + i) for i, size in enumerate(sizes)]
            start = time.perf_counter()
            r = httpx.post(server.base_url + "/v1/chat/completions", json=_body(images, kwargs), timeout=600)
            e2e = time.perf_counter() - start
            if r.status_code != 200:
                raise RuntimeError(f"{label}: HTTP {r.status_code} {r.text[:200]}")
            flows = httpx.get(server.base_url + "/strata/stats", timeout=60).json()["ingress"]["flows"]
            trace = next(f for f in reversed(flows) if f["request_id"] == r.json()["id"])
            rows.append({"mode": mode, "request": label, "image_bytes": sum(len(b) for b in images),
                         "prompt_tokens": r.json()["usage"]["prompt_tokens"], "e2e_s": e2e, **trace})
    finally:
        server.stop()
    return rows


def run(args: argparse.Namespace) -> int:
    from strata.bench.vision import bench_model_dir

    model = bench_model_dir(args.model)
    rows = [row for mode in args.modes for row in _run_mode(model, mode)]
    print(f"# strata bench flow: {model.name}, a real server per mode; per request, each hop's bytes sent / "
          "received and seconds at the front door, the KV its prompt left in the host tier, the client's e2e")
    for row in rows:
        hops = "  ".join(f"{h['name']} {h['sent'] / 1e6:.2f}/{h['received'] / 1e6:.2f} MB {h['seconds'] * 1e3:.0f} ms"
                         for h in row["hops"])
        kv = f"  kv host tier {row['kv_host_tier_bytes'] / 1e6:.2f} MB" if row["kv_host_tier_bytes"] else ""
        print(f"  {row['mode']:<13} {row['request']:<18} {row['prompt_tokens']:>6} tok  e2e {row['e2e_s'] * 1e3:6.0f} ms  "
              f"{hops}{kv}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0

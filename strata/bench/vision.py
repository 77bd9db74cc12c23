"""`strata bench vision`: images that cost hundreds to thousands of tokens, on a small Qwen2.5-VL.

Three comparisons, each side by side in one run on one loaded model (fp32, this machine's cores):

* **Encoder throughput**, for a mix of sizes (``--sizes``: a thumbnail to a photo of ~2K tokens, several
  aspect ratios) and for 16 thumbnails: images packed into calls of at most ``encoder_batch_patches``
  (the default; every linear layer runs once per call, attention in batches of equal-size windows and
  images, nothing padded), against every image in one call and against one call per image. The
  encoder cache is emptied before every call, so every side computes every image. Rounds alternate
  the sides; medians are reported.
* **TTFT** of one request with 1 image and with 4 images of mixed sizes through the in-process engine
  (preprocess, encode, chunked prefill, first token), caches cold.
* **A repeated image**: the same request again: the encoder cache and the KV prefix cache answer
  (``cached_tokens`` reported), against the cold first time.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.checkpoints.tiny_model import default_cache_dir

# A small Qwen2.5-VL: a 12-block ViT of width 256 (windows of 112 px, full attention every 4th block) over a
# 4-layer decoder of width 512; images up to 1792 x 1792 px = 4096 tokens.
SMALL_TEXT = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                          "mrope_section": [8, 12, 12]})
SMALL_VISION = dict(depth=12, hidden_size=256, intermediate_size=688, num_heads=4, window_size=112,
                    fullatt_block_indexes=[3, 7, 11])
DEFAULT_SIZES = ("224x224", "448x336", "640x480", "336x896", "1024x768", "1344x1008")
PROMPT = "Describe each picture in one sentence."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("small", "tiny"), default="small",
                   help="small: the model above; tiny: the tests' Qwen2.5-VL (a smoke run)")
    p.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="image sizes WxH for the encoder batch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens")
    p.add_argument("--json", type=Path)


def bench_model_dir(size: str = "small") -> Path:
    from strata.checkpoints.tiny_qwen_vl import build_tiny_qwen2_5_vl

    path = default_cache_dir() / "bench" / f"{size}-qwen2.5-vl"
    if not (path / "config.json").is_file():
        if size == "tiny":
            build_tiny_qwen2_5_vl(path, max_pixels=448 * 448)
        else:
            build_tiny_qwen2_5_vl(path, max_pixels=1792 * 1792, text=SMALL_TEXT, vision=SMALL_VISION)
    return path


def photo(width: int, height: int, seed: int) -> bytes:
    """A PNG with structure at every scale (gradients and noise), so resizing has real work to do."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    pixels = (base + rng.integers(0, 40, (height, width, 3))).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _sizes(values: list[str]) -> list[tuple[int, int]]:
    try:
        return [tuple(int(v) for v in s.lower().split("x", 1)) for s in values]  # type: ignore[misc]
    except ValueError:
        raise SystemExit(f"strata: error: --sizes takes WxH values, got {values}") from None


def _encode_seconds(encoder: Any, images: list[Any], budget: int) -> float:
    """One Encode-stage call over ``images`` packed by ``budget`` patches per forward, caches emptied."""
    encoder._cache.clear()  # every side computes every image
    encoder.config.encoder_batch_patches = budget
    start = time.perf_counter()
    encoder.encode(images)
    return time.perf_counter() - start


def _encoder_rows(encoder: Any, label: str, images: list[Any], rounds: int) -> dict[str, float]:
    budget = EngineConfig().encoder_batch_patches
    sides = {f"packed by {budget} patches (default)": budget, "all in one call": 0, "one call per image": 1}
    runs: dict[str, list[float]] = {name: [] for name in sides}
    _encode_seconds(encoder, images, budget)  # warm-up
    for _ in range(rounds):
        for name, b in sides.items():
            runs[name].append(_encode_seconds(encoder, images, b))
    med = {name: statistics.median(v) for name, v in runs.items()}
    tokens = sum(p.num_tokens for p in images)
    print(f"encoder, {label}: {len(images)} images, {tokens} tokens, median of {rounds} alternating rounds:")
    base = med["one call per image"]
    for name, seconds in med.items():
        print(f"  {name:<34} {seconds * 1000:7.0f} ms  {len(images) / seconds:6.2f} images/s  "
              f"{tokens / seconds:7.0f} tok/s  {base / seconds:5.2f}x vs one call per image")
    encoder.config.encoder_batch_patches = budget
    return med


def _ttft(engine: Any, images: list[bytes], rid: str) -> tuple[float, int, int]:
    """Seconds to the first token of one request (preprocess and encode included), its prompt and cached tokens."""
    start = time.perf_counter()
    request = engine.prepare(rid, SamplingParams(max_tokens=1, temperature=0.0), images, prompt=PROMPT)
    engine.add(request)
    first = None
    while engine.has_unfinished():
        for event in engine.step():
            first = first if first is not None else event
    assert first is not None and first.finish_reason != "error", first
    return time.perf_counter() - start, request.num_prompt_tokens, first.num_cached_tokens


def run(args: argparse.Namespace) -> int:
    import torch

    from strata.stages.factory import build_engine

    model = bench_model_dir(args.model)
    engine = build_engine(model, EngineConfig(prefill_chunk_tokens=args.chunk, max_num_batched_tokens=args.chunk,
                                              max_model_len=16384, num_kv_blocks=2048))
    sizes = _sizes(args.sizes)
    images = [photo(w, h, i) for i, (w, h) in enumerate(sizes)]
    processed = [engine.preprocessor.process(b) for b in images]
    tokens = [p.num_tokens for p in processed]
    shape = (f"{SMALL_VISION['depth']}-block ViT width {SMALL_VISION['hidden_size']}, windows "
             f"{SMALL_VISION['window_size']} px; {SMALL_TEXT['num_hidden_layers']}-layer decoder width "
             f"{SMALL_TEXT['hidden_size']}") if args.model == "small" else "the tests' tiny checkpoint"
    print(f"# strata bench vision: {args.model} Qwen2.5-VL ({shape}), fp32, {torch.get_num_threads()} threads")
    print(f"# images: {', '.join(f'{w}x{h}={n} tok' for (w, h), n in zip(sizes, tokens))}")
    mixed = _encoder_rows(engine.encoder, "mixed sizes", processed, args.rounds)
    thumbs = [engine.preprocessor.process(photo(224, 224, 100 + i)) for i in range(16)]
    small = _encoder_rows(engine.encoder, "16 thumbnails of 224x224", thumbs, args.rounds)
    n = len(images)

    four = [images[i % n] for i in (1, 2, 3, 4)]
    one_s, one_tokens, _ = _ttft(engine, [images[min(2, n - 1)]], "one")
    four_s, four_tokens, _ = _ttft(engine, four, "four")
    engine.encoder._cache.clear()
    repeated = images[min(4, n - 1)]
    cold_s, cold_tokens, cold_cached = _ttft(engine, [repeated], "cold")
    warm_s, _, warm_cached = _ttft(engine, [repeated], "warm")
    print("TTFT through the in-process engine (preprocess + encode + chunked prefill + first token):")
    print(f"  1 image   {one_tokens:6d} prompt tokens  {one_s * 1000:8.0f} ms")
    print(f"  4 images  {four_tokens:6d} prompt tokens  {four_s * 1000:8.0f} ms")
    print(f"  repeated image: cold {cold_s * 1000:.0f} ms ({cold_cached} cached of {cold_tokens}), again "
          f"{warm_s * 1000:.0f} ms ({warm_cached} cached): {cold_s / warm_s:.1f}x")
    if args.json:
        args.json.write_text(json.dumps({"sizes": args.sizes, "image_tokens": tokens, "encoder_mixed_seconds": mixed,
                                         "encoder_thumbnails_seconds": small,
                                         "ttft_one": one_s, "ttft_four": four_s, "ttft_cold": cold_s,
                                         "ttft_repeated": warm_s, "repeated_cached_tokens": warm_cached}, indent=2))
    return 0

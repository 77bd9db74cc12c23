"""Contexts far beyond the device tier: spilled blocks stream back through the staging buffer
and the tokens stay exactly what an all-on-device run (and transformers) produce."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
import torch
from PIL import Image

from helpers import build, greedy

pytestmark = [pytest.mark.usefixtures("attention_backend"), pytest.mark.slow]  # fast and reference backends; long prompts

DEVICE_BLOCKS = 96  # 1,536 tokens of device tier


def _kv(engine):
    return engine.kv


def _ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def test_16k_prompt_on_a_1_5k_device_tier_matches_all_on_device(llama_dir: Path, tmp_path: Path) -> None:
    ids = _ids(16_384)
    request = [{"prompt_token_ids": ids, "params": greedy(8)}]
    full = build(llama_dir, max_model_len=17_000, num_kv_blocks=1_100).generate(request)[0]
    tiered = build(
        llama_dir, max_model_len=17_000, num_kv_blocks=DEVICE_BLOCKS, host_kv_blocks=1_100,
        host_kv_dir=str(tmp_path / "host"), kv_staging_blocks=32,
    )
    out = tiered.generate(request)[0]
    assert out.output_token_ids == full.output_token_ids
    stats = _kv(tiered).stats()
    assert stats["device"]["peak_in_use"] <= DEVICE_BLOCKS
    # most of the context really lived off the device while it was attended to
    assert stats["peak_spilled_blocks"] >= 16_384 // 16 - DEVICE_BLOCKS
    assert stats["spilled_blocks"] == 0  # and every pin was released at the end
    assert _kv(tiered).lower.top.num_pinned() == 0


@pytest.fixture(scope="module")
def hf_llama(tiny_models: dict[str, Path]):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = tiny_models["llava-llama"]
    return LlavaForConditionalGeneration.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)


def test_4k_prompt_with_an_image_on_a_small_device_tier_matches_transformers(
    llama_dir: Path, tmp_path: Path, hf_llama, demo_images: list[bytes]
) -> None:
    hf, processor = hf_llama
    engine = build(
        llama_dir, max_model_len=6_000, num_kv_blocks=48, prefill_chunk_tokens=256,
        host_kv_blocks=400, host_kv_dir=str(tmp_path / "host"), kv_staging_blocks=16,
    )
    prompt = "Describe the picture, then continue the tale of the sea and the stars. " * 125
    text = engine.tokenizer.render_user_prompt(prompt, 1)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(demo_images[0]))], return_tensors="pt")
    assert 3_500 < inputs["input_ids"].shape[1] < 5_000
    with torch.inference_mode():
        ref = hf.generate(**inputs, max_new_tokens=10, do_sample=False)[0, inputs["input_ids"].shape[1] :]
    out = engine.generate([{"prompt": prompt, "images": demo_images[:1], "params": greedy(10)}])[0]
    assert out.output_token_ids == ref.tolist()
    assert _kv(engine).spills.peak > 150


def test_sliding_window_model_spills_and_skips_blocks_outside_the_window(tiny_models, tmp_path: Path) -> None:
    ids = _ids(1_500, seed=3)
    request = [{"prompt_token_ids": ids, "params": greedy(12)}]
    mistral = tiny_models["llava-mistral"]
    full = build(mistral, max_model_len=2_000).generate(request)[0]
    tiered = build(
        mistral, max_model_len=2_000, num_kv_blocks=24, prefill_chunk_tokens=128,
        host_kv_blocks=200, host_kv_dir=str(tmp_path / "host"),
    )
    assert tiered.generate(request)[0].output_token_ids == full.output_token_ids
    host = _kv(tiered).lower.top
    # each 128-token chunk reads at most the few blocks its 48-token window reaches, not the whole prefix
    assert host.counters["hits"] < 200 * len(tiered.core.runner.model.layers)


def test_prefix_in_the_host_tier_is_reused_even_when_it_exceeds_the_device(llama_dir: Path, tmp_path: Path) -> None:
    shared = _ids(3_000, seed=5)
    config = dict(
        max_model_len=4_000, num_kv_blocks=64, prefill_chunk_tokens=256,
        host_kv_blocks=600, host_kv_dir=str(tmp_path / "host"),
    )
    first = build(llama_dir, **config)
    first.generate([{"prompt_token_ids": shared + _ids(40, seed=6), "params": greedy(4)}])
    second_prompt = shared + _ids(40, seed=7)
    cold = build(llama_dir, max_model_len=4_000).generate([{"prompt_token_ids": second_prompt, "params": greedy(8)}])[0]
    fresh = build(llama_dir, **config)  # a new device pool: the prefix is only in the host tier
    out = fresh.generate([{"prompt_token_ids": second_prompt, "params": greedy(8)}])[0]
    assert out.output_token_ids == cold.output_token_ids
    assert out.num_cached_tokens == 3_000 // 16 * 16
    hits = _kv(fresh).stats()["prefix_hit_tokens"]
    assert hits["host"] == out.num_cached_tokens and hits["device"] == 0


def test_a_spilled_block_lost_mid_request_is_recomputed_not_served(llama_dir: Path, tmp_path: Path) -> None:
    ids = _ids(2_000, seed=9)
    request = {"prompt_token_ids": ids, "params": greedy(6)}
    full = build(llama_dir, max_model_len=3_000).generate([request])[0]
    engine = build(
        llama_dir, max_model_len=3_000, num_kv_blocks=40, prefill_chunk_tokens=128,
        host_kv_blocks=300, host_kv_dir=str(tmp_path / "host"),
    )
    rid = engine.add_request(**request)
    host = _kv(engine).lower.top
    damaged = False
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        seq = engine._requests.get(rid)
        if not damaged and seq is not None and seq.block_table.num_spilled > 4:
            path = Path(host.files.path(seq.block_hashes[1]))
            path.write_bytes(path.read_bytes()[:-8])  # truncate a block the request still reads
            pool = _kv(engine).pool
            victim = pool.lookup(seq.block_hashes[1])
            if victim is not None:  # make sure the device cannot serve it either
                pool._by_hash.pop(seq.block_hashes[1])
                pool._hash[victim] = None
            damaged = True
    assert damaged and host.counters["corrupt"] >= 1
    assert engine.core.scheduler.num_preemptions >= 1
    assert [o.token_id for o in outputs if o.request_id == rid] == full.output_token_ids


def test_many_requests_sharing_a_prefix_on_a_small_device_tier(llama_dir: Path, tmp_path: Path) -> None:
    """Shared prefix blocks free nothing when one holder spills them; the scheduler must still
    make progress (spilling private blocks, or preempting) and every output must be exact."""
    shared = _ids(600, seed=11)
    requests = [{"prompt_token_ids": shared + _ids(200, seed=20 + i), "params": greedy(6)} for i in range(6)]
    full = build(llama_dir, max_model_len=1_000).generate(requests)
    tiered = build(
        llama_dir, max_model_len=1_000, num_kv_blocks=64, prefill_chunk_tokens=128, max_num_batched_tokens=256,
        host_kv_blocks=600, host_kv_dir=str(tmp_path / "host"),
    )
    outs = tiered.generate(requests)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in full]
    assert _kv(tiered).stats()["device"]["peak_in_use"] <= 64
    assert _kv(tiered).lower.top.num_pinned() == 0 and _kv(tiered).spills.current == 0

"""Greedy tokens do not depend on how the engine schedules: chunk size, batch, cache, preemption."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import build, greedy

pytestmark = pytest.mark.usefixtures("attention_backend")  # fast and reference backends

PROMPTS = [
    "Describe the picture.",
    "What colour is the circle?",
    "Tell me a long story about a lighthouse keeper.",
    "Count from one to ten.",
    "Why is the sky blue?",
    "Write a poem.",
    "Summarise the image in one sentence.",
    "List three animals.",
]


def _requests(images: list[bytes], max_tokens: int = 16) -> list[dict]:
    """8 mixed requests: text only, one image, two images; different lengths."""
    reqs = []
    for i, prompt in enumerate(PROMPTS):
        imgs = [] if i % 3 == 0 else images[: 1 + (i % 2)]
        reqs.append({"prompt": prompt, "images": imgs, "params": greedy(max_tokens + i)})
    return reqs


def _tokens(engine, reqs: list[dict]) -> list[list[int]]:
    return [o.output_token_ids for o in engine.generate(reqs)]


@pytest.fixture(scope="module")
def baseline(llama_dir: Path, demo_images, attention_backend: str) -> list[list[int]]:
    """Each request alone, prefix caching off, whole prompt in one chunk."""
    engine = build(llama_dir, enable_prefix_caching=False)
    return [_tokens(engine, [r])[0] for r in _requests(demo_images)]


@pytest.mark.parametrize("chunk", [3, 7, 16, 40])
def test_chunk_size_does_not_change_tokens(chunk: int, llama_dir, demo_images, baseline) -> None:
    # 3 and 7 split every image span (16 placeholder tokens) across chunks.
    engine = build(llama_dir, prefill_chunk_tokens=chunk, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert _tokens(engine, _requests(demo_images)) == baseline


def test_prefix_caching_on_equals_off(llama_dir, demo_images, baseline) -> None:
    """Each request alone with the default engine (caching on): the hand-off from prefill to decode
    covers every block whether or not blocks are published."""
    engine = build(llama_dir)
    assert [_tokens(engine, [r])[0] for r in _requests(demo_images)] == baseline


def test_batched_equals_one_at_a_time(llama_dir, demo_images, baseline) -> None:
    engine = build(llama_dir)
    assert _tokens(engine, _requests(demo_images)) == baseline


def test_prefix_cache_hit_equals_cold(llama_dir, demo_images, baseline) -> None:
    engine = build(llama_dir)
    reqs = _requests(demo_images)
    first = engine.generate(reqs)
    second = engine.generate(_requests(demo_images))
    assert [o.output_token_ids for o in second] == baseline
    assert all(o.num_cached_tokens == 0 for o in first[:1])
    assert sum(o.num_cached_tokens for o in second) > 0
    # The second turn of a chat reuses the first turn's blocks. (Only up to where re-tokenizing the
    # rendered answer agrees with the generated ids: BPE may merge across the turn boundary.)
    opening = "Hello there, I would like to hear a long story about ships, the sea and the old lighthouse."
    turn1 = engine.generate([{"messages": [{"role": "user", "content": opening}], "params": greedy(20)}])[0]
    answer = engine.tokenizer.decode(turn1.output_token_ids)
    chat = [
        {"role": "user", "content": opening},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And then?"},
    ]
    turn2 = engine.generate([{"messages": chat, "params": greedy(4)}])[0]
    assert turn2.num_cached_tokens >= 16


def test_preemption_under_a_small_pool(llama_dir, demo_images) -> None:
    reqs = _requests(demo_images, max_tokens=40)
    roomy = build(llama_dir)
    alone = [_tokens(roomy, [r])[0] for r in reqs]
    # Each request needs up to 7 blocks as it grows; 8 of them cannot all fit in 12.
    engine = build(llama_dir, num_kv_blocks=12, max_num_batched_tokens=64, prefill_chunk_tokens=32)
    assert _tokens(engine, _requests(demo_images, max_tokens=40)) == alone
    assert engine.scheduler.num_preemptions > 0
    pool = engine.kv.pool
    pool.check_invariants()
    assert pool.stats()["in_use"] == 0, "every block is released when all requests finish"


def test_other_image_never_reuses_image_blocks(llama_dir, demo_images) -> None:
    engine = build(llama_dir, block_size=16)
    prompt = "What is in this picture? Please answer in great detail."
    first = engine.generate([{"prompt": prompt, "images": demo_images[:1], "params": greedy(8)}])[0]
    same = engine.generate([{"prompt": prompt, "images": demo_images[:1], "params": greedy(8)}])[0]
    other = engine.generate([{"prompt": prompt, "images": demo_images[1:2], "params": greedy(8)}])[0]
    text = engine.tokenizer.render_user_prompt(prompt, 1)
    image_offset = engine.tokenizer.encode(text, 1).image_offsets[0]
    assert same.num_cached_tokens > image_offset + 16, "same image: the image blocks are reused"
    assert other.num_cached_tokens <= image_offset, "another image: nothing from the image on may hit"
    assert same.output_token_ids == first.output_token_ids
    solo = build(llama_dir).generate([{"prompt": prompt, "images": demo_images[1:2], "params": greedy(8)}])[0]
    assert other.output_token_ids == solo.output_token_ids


@pytest.mark.slow
def test_a_compiled_step_gives_the_eager_tokens(llama_dir, demo_images, baseline) -> None:
    """EngineConfig.compile (torch.compile of the dense step parts) changes speed, never tokens."""
    engine = build(llama_dir, compile=True, enable_prefix_caching=False)
    assert engine.core.runner.compile_seconds > 0
    assert _tokens(engine, _requests(demo_images)) == baseline

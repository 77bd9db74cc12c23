"""A sliding-window cache group keeps only its window on the device (gpt-oss: window 12 on layers 0 and 2
of the tiny checkpoint): a long prompt runs in a windowed pool a fraction of the full one's size and its
tokens stay transformers', a prefix hit claims the window at its end, and a window whose part was
reclaimed is computed again, never read."""

from __future__ import annotations

import pytest
from helpers import build, greedy, transformers_greedy

LONG = "Tell me the whole story of the sea and the stars, from the start. " * 12  # ~200 tokens: many windows
SMALL_WINDOWS = dict(block_size=4, num_kv_blocks=160, max_num_seqs=2, max_num_batched_tokens=32,
                     prefill_chunk_tokens=32, max_model_len=512)


def _window(engine) -> dict[str, int]:
    (stats,) = engine.kv.stats()["window_slots"]
    return stats


def test_a_long_prompt_needs_only_its_window_of_the_sliding_group(text_models) -> None:
    model_dir = text_models["gpt_oss"]
    engine = build(model_dir, **SMALL_WINDOWS)
    full, sliding = engine.kv.pool.kv.groups
    assert full.shape[0] == 160 and sliding.shape[0] == 2 * (3 + 3) + 8  # window_slot_counts: 20 slots
    out = engine.generate([{"prompt": LONG, "params": greedy(8, ignore_eos=True)}])[0]
    assert out.output_token_ids == transformers_greedy(model_dir, LONG, 8)
    assert out.num_prompt_tokens > 150 and _window(engine)["peak_claimed"] <= 20
    engine.kv.pool.check_invariants()
    stats = _window(engine)
    assert stats["claimed"] == 0 and stats["idle"] > 0  # the finished prompt's last windows stay for reuse


def test_a_prefix_hit_claims_the_window_at_its_end_and_equals_a_fresh_run(text_models) -> None:
    model_dir = text_models["gpt_oss"]
    engine = build(model_dir, **SMALL_WINDOWS)
    first = engine.generate([{"prompt": LONG, "params": greedy(8, ignore_eos=True)}])[0]
    again = engine.generate([{"prompt": LONG, "params": greedy(8, ignore_eos=True)}])[0]
    assert again.output_token_ids == first.output_token_ids
    assert again.num_cached_tokens >= first.num_prompt_tokens - 4
    engine.kv.pool.check_invariants()


def test_a_window_whose_part_was_reclaimed_is_computed_again(text_models) -> None:
    """Other prompts take every idle slot: the first prompt's blocks are still cached for the full layers,
    but the window at their end is gone, so the match stops before it and those tokens are recomputed."""
    model_dir = text_models["gpt_oss"]
    engine = build(model_dir, **SMALL_WINDOWS)
    first = engine.generate([{"prompt": LONG, "params": greedy(8, ignore_eos=True)}])[0]
    others = [f"Another question, number {i}, about rivers and their long way to the sea." * 2 for i in range(6)]
    engine.generate([{"prompt": p, "params": greedy(2)} for p in others])
    assert _window(engine)["reclaimed"] > 0
    again = engine.generate([{"prompt": LONG, "params": greedy(8, ignore_eos=True)}])[0]
    assert again.output_token_ids == first.output_token_ids
    assert again.num_cached_tokens < first.num_prompt_tokens - 4
    engine.kv.pool.check_invariants()


def test_concurrent_sequences_beyond_the_running_limit_share_the_windowed_slots(text_models) -> None:
    model_dir = text_models["gpt_oss"]
    engine = build(model_dir, **SMALL_WINDOWS)
    prompts = [LONG, "What is the capital of France? The quick brown fox jumps over the lazy dog.",
               "Tell me about the tides and the moon. " * 4]
    outs = engine.generate([{"prompt": p, "params": greedy(6, ignore_eos=True)} for p in prompts])
    for prompt, out in zip(prompts, outs):
        assert out.error is None and out.output_token_ids == transformers_greedy(model_dir, prompt, 6)
    engine.kv.pool.check_invariants()


@pytest.mark.slow
def test_tp2_lends_the_same_slots_on_every_rank(text_models) -> None:
    model_dir = text_models["gpt_oss"]
    reqs = [{"prompt": LONG, "params": greedy(6, ignore_eos=True)}]
    expected = [o.output_token_ids for o in build(model_dir, **SMALL_WINDOWS).generate(reqs)]
    two = build(model_dir, tp=2, **SMALL_WINDOWS)
    try:
        assert [o.output_token_ids for o in two.generate(reqs)] == expected
        assert [o.output_token_ids for o in two.generate(reqs)] == expected  # a prefix hit, rank 1 in step
    finally:
        two.close()

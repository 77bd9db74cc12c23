"""The in-process engine as a user drives it: validation, abort, stop strings, seeded sampling."""

from __future__ import annotations

import time

import pytest

from helpers import build, greedy
from strata.pipeline.contract.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(llama_dir):
    return build(llama_dir, max_model_len=256)


def test_abort_mid_generation_frees_every_block(engine, demo_images) -> None:
    pool = engine.kv.pool
    baseline = pool.stats()["in_use"]
    rid = engine.add_request("Tell me everything.", images=demo_images[:1], params=greedy(100, ignore_eos=True))
    other = engine.add_request("And you?", params=greedy(5))
    for _ in range(3):
        engine.step()
    assert pool.stats()["in_use"] > baseline
    engine.abort(rid)
    outs = list(engine.run())
    assert {o.request_id for o in outs} == {other}
    assert pool.stats()["in_use"] == baseline
    pool.check_invariants()


@pytest.mark.parametrize(
    "request_kwargs, message",
    [
        ({"prompt": "hi", "params": greedy(300)}, "max_model_len"),
        ({"prompt": "", "params": greedy(4)}, "empty"),
        ({"raw_prompt": "no image token here", "images": [b"x"], "params": greedy(4)}, "placeholder"),
        ({"prompt": "hi", "params": SamplingParams(top_p=0)}, "top_p"),
        ({"prompt_token_ids": [1, 2, 10**6], "params": greedy(4)}, "token ids"),
    ],
)
def test_bad_requests_are_rejected_before_queueing(engine, request_kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request(**request_kwargs)
    assert not engine.has_unfinished()


def test_stop_string_truncates_and_finishes(engine) -> None:
    full = engine.generate([{"prompt": "Say something.", "params": greedy(20, ignore_eos=True)}])[0]
    text = engine.tokenizer.decode(full.output_token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    rid = engine.add_request("Say something.", params=greedy(20, ignore_eos=True, stop=[stop]))
    outs = [o for o in engine.run() if o.request_id == rid]
    streamed = "".join(o.text_delta for o in outs)
    assert outs[-1].finish_reason == "stop"
    assert streamed == text[: text.index(stop)]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine) -> None:
    params = dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = engine.generate([{"prompt": "Pick words.", "params": SamplingParams(**params)}])[0]
    batch = engine.generate(
        [{"prompt": "Other request.", "params": SamplingParams(max_tokens=7, temperature=1.0)}]
        + [{"prompt": "Pick words.", "params": SamplingParams(**params)}]
    )[1]
    assert alone.output_token_ids == batch.output_token_ids
    other_seed = engine.generate([{"prompt": "Pick words.", "params": SamplingParams(**{**params, "seed": 99})}])[0]
    assert other_seed.output_token_ids != alone.output_token_ids


def test_stats_count_the_steps_their_time_and_tokens(engine) -> None:
    """``/strata/stats`` splits a served token into the engine's step and the path around it from these."""
    from strata.stages.engine_service import engine_stats

    before = dict(engine_stats(engine)["step_totals"])
    engine.add_request(prompt_token_ids=[5, 6, 7, 8, 9], params=greedy(3, ignore_eos=True))
    steps = 0
    started = time.monotonic()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    ended = time.monotonic()
    stats = engine_stats(engine)
    after = stats["step_totals"]
    assert after["steps"] - before["steps"] == steps
    assert after["seconds"] > before["seconds"]
    assert after["tokens"] - before["tokens"] == 5 + 2  # the prompt's 5, then one for each later token
    # each step on the host's clock, one after the other, with the CPU it used and its tokens
    last = stats["recent_steps"][-steps:]
    assert [n for *_, n in last] == [5, 1, 1]
    assert all(started <= t and t + s <= ended and 0 < c for t, s, c, _ in last)
    assert all(a[0] + a[1] <= b[0] for a, b in zip(last, last[1:]))

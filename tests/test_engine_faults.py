"""Failures inside the engine stay with the request they belong to: a request whose forward raises or
whose logits go bad fails alone with an error event, a degenerate sampling setting behaves as greedy,
a deadline ends a request that runs too long, and a stage loop whose step raises fails its callers
promptly instead of hanging them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from helpers import build, greedy
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.model_runner import ModelRunner
from strata.stages.engine_service import EngineService

PROMPTS = ["Tell me about the tides.", "What is a lighthouse?", "Count the waves.", "Describe the harbour."]


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> list[list[int]]:
    engine = build(llama_dir)
    return [o.output_token_ids for o in engine.generate([{"prompt": p, "params": greedy(10)} for p in PROMPTS])]


def test_a_request_whose_forward_raises_fails_alone(llama_dir: Path, expected, monkeypatch) -> None:
    engine = build(llama_dir)
    original = ModelRunner.prepare

    def poisoned(self, chunks):
        if any(c.seq.request_id == "poison" for c in chunks):
            raise RuntimeError("a bug that only this request triggers")
        return original(self, chunks)

    monkeypatch.setattr(ModelRunner, "prepare", poisoned)
    ids = [engine.add_request(prompt=p, params=greedy(10)) for p in PROMPTS[:2]]
    engine.add_request(prompt=PROMPTS[2], params=greedy(10), request_id="poison")
    ids += [engine.add_request(prompt=PROMPTS[3], params=greedy(10))]
    events = list(engine.run())
    poison = [e for e in events if e.request_id == "poison"]
    assert len(poison) == 1 and poison[0].finish_reason == "error" and "internal error" in poison[0].error
    got = {i: [e.token_id for e in events if e.request_id == i] for i in ids}
    assert [got[i] for i in ids] == [expected[0], expected[1], expected[3]]
    assert engine.kv.pool.stats()["in_use"] == 0


def test_nan_logits_fail_their_own_sequence(llama_dir: Path, expected, monkeypatch) -> None:
    engine = build(llama_dir)
    original = ModelRunner.execute

    def nan_for_one(self, chunks):
        logits = original(self, chunks)
        rows = [c for c in chunks if c.samples]
        for i, c in enumerate(rows):
            if c.seq.request_id == "nan" and c.seq.output_token_ids:
                logits[i] = float("nan")
        return logits

    monkeypatch.setattr(ModelRunner, "execute", nan_for_one)
    good = engine.add_request(prompt=PROMPTS[0], params=greedy(10))
    engine.add_request(prompt=PROMPTS[1], params=greedy(10), request_id="nan")
    events = list(engine.run())
    assert [e.finish_reason for e in events if e.request_id == "nan"][-1] == "error"
    assert [e.token_id for e in events if e.request_id == good] == expected[0]


@pytest.mark.parametrize("where", ["sampler", "stop rules"])
def test_a_row_whose_sampling_or_stop_rules_raise_fails_alone(llama_dir: Path, expected, monkeypatch, where: str) -> None:
    """A fault that belongs to one row after the forward (its sampler, its logits processor, its stop rules)
    ends that row with an error event; the rows batched with it keep exactly their tokens."""
    import strata.pipeline.core.engine_core as engine_core
    from strata.pipeline.core.sampler import Sampler

    engine = build(llama_dir)
    if where == "sampler":
        original = Sampler._sample

        def poisoned(self, logits, params, generators):
            if any(p.seed == 666 for p in params):
                raise RuntimeError("a bug that only this request's sampling triggers")
            return original(self, logits, params, generators)

        monkeypatch.setattr(Sampler, "_sample", poisoned)
    else:
        check = engine_core.check_stop

        def poisoned_stop(output_ids, eos, params, *args, **kwargs):
            if params.seed == 666 and len(output_ids) == 3:
                raise RuntimeError("a bug in this request's stop rules")
            return check(output_ids, eos, params, *args, **kwargs)

        monkeypatch.setattr(engine_core, "check_stop", poisoned_stop)
    ids = [engine.add_request(prompt=p, params=greedy(10)) for p in PROMPTS[:2]]
    engine.add_request(prompt=PROMPTS[2], params=greedy(10, seed=666), request_id="poison")
    ids += [engine.add_request(prompt=PROMPTS[3], params=greedy(10))]
    events = list(engine.run())
    poison = [e for e in events if e.request_id == "poison"]
    assert poison[-1].finish_reason == "error" and poison[-1].error == "an internal error stopped this request"
    got = {i: [e.token_id for e in events if e.request_id == i] for i in ids}
    assert [got[i] for i in ids] == [expected[0], expected[1], expected[3]]
    assert engine.kv.pool.stats()["in_use"] == 0


def test_a_vanishing_temperature_behaves_as_greedy_and_stalls_nothing(llama_dir: Path, expected) -> None:
    engine = build(llama_dir)
    outs = engine.generate([{"prompt": PROMPTS[0], "params": SamplingParams(max_tokens=10, temperature=1e-300)},
                            {"prompt": PROMPTS[1], "params": greedy(10)}])
    assert [o.output_token_ids for o in outs] == expected[:2]


def test_a_request_past_its_deadline_ends_with_an_error(llama_dir: Path) -> None:
    engine = build(llama_dir, request_timeout_s=0.2)
    rid = engine.add_request(prompt=PROMPTS[0], params=SamplingParams(max_tokens=100_000 // 100, temperature=0,
                                                                      ignore_eos=True))
    t0 = time.monotonic()
    last = None
    for ev in engine.run():
        last = ev
        time.sleep(0.001)
    assert last is not None and last.request_id == rid and last.finish_reason == "error"
    assert "did not finish within" in last.error and time.monotonic() - t0 < 5


def test_a_step_that_raises_fails_its_callers_promptly_and_the_service_recovers(llama_dir: Path, monkeypatch) -> None:
    engine = build(llama_dir)
    service = EngineService(engine)
    calls = {"n": 0}
    original = engine.step

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("the scheduler tripped over itself")
        return original()

    monkeypatch.setattr(engine, "step", flaky)
    try:
        async def one(i: int, tokens: int):
            request = engine.intake.make_request(f"flaky-{i}", greedy(tokens), prompt=PROMPTS[i])[0]
            events = []
            async for batch in service.generate(request):
                events += batch
            return events

        async def main():
            return await asyncio.wait_for(asyncio.gather(one(0, 20), one(1, 20)), timeout=30)

        first = asyncio.run(main())
        for events in first:
            assert events[-1].finish_reason == "error"
        assert engine.kv.pool.stats()["in_use"] == 0 and not engine.has_unfinished()
        again = asyncio.run(asyncio.wait_for(one(2, 5), timeout=30))  # the replica serves on
        assert again[-1].finish_reason in ("length", "stop") and service.loop.failures == 1
    finally:
        service.close()

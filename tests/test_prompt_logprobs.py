"""Prompt logprobs in the engine (``pipeline.core.prompt_logprobs``): every prompt token's log-probability
given those before it is transformers' own, the same whatever the prefill chunk, the same with the prefix
cache warm as cold, the same after preemption recomputes the prompt, and carried by the prefill stage's first
event across the hand-off. lm-eval's loglikelihood and perplexity tasks read exactly these numbers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from helpers import build, greedy

from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.handoff import Handoff
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.stages.factory import build_decode_service, build_prefill_service

TEXT = ("The tide comes in twice a day, pulled by the moon and the sun; sailors learn its hours before they "
        "learn the stars, and the old harbour keeps a table of them by the door.")


def _reference(model_dir: Path, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' logprob of each prompt token after the first, its rank, and the top-k ids and values."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]
    chosen = lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    ranks = (lp > chosen[:, None]).sum(1) + 1
    values, top_ids = lp.topk(k, dim=-1)
    return chosen, ranks, top_ids, values


def _run(engine, ids: list[int], k: int = 3, max_tokens: int = 2):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=k)
    return engine.generate([{"prompt_token_ids": ids, "params": params}])[0]


@pytest.fixture(scope="module")
def model_dir(text_models) -> Path:
    return text_models["qwen3"]


@pytest.fixture(scope="module")
def prompt_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(TEXT)["input_ids"]


def test_prompt_logprobs_equal_transformers(model_dir: Path, prompt_ids: list[int]) -> None:
    out = _run(build(model_dir, prefill_chunk_tokens=8), prompt_ids)
    chosen, ranks, top_ids, values = _reference(model_dir, prompt_ids, 3)
    got = out.prompt_logprobs
    assert out.error is None and len(got) == len(prompt_ids) - 1 > 16
    torch.testing.assert_close(torch.tensor([p.logprob for p in got]), chosen, rtol=0, atol=1e-4)
    assert [p.rank for p in got] == ranks.tolist()
    assert [[t for t, _ in p.top] for p in got] == top_ids.tolist()
    torch.testing.assert_close(torch.tensor([[v for _, v in p.top] for p in got]), values, rtol=0, atol=1e-4)


def test_chunking_and_a_warm_prefix_cache_change_no_number(model_dir: Path, prompt_ids: list[int]) -> None:
    """One chunk or chunks of 5 (cutting blocks), cold or with the prompt's blocks already cached: the same
    values, bit for bit in the chunked pair; the warm request reports no cached token (it recomputed)."""
    whole = _run(build(model_dir, prefill_chunk_tokens=512), prompt_ids)
    engine = build(model_dir, prefill_chunk_tokens=5)
    plain = engine.generate([{"prompt_token_ids": prompt_ids, "params": greedy(2)}])[0]  # warms the cache
    again = engine.generate([{"prompt_token_ids": prompt_ids, "params": greedy(2)}])[0]
    assert again.num_cached_tokens > 16, "the prompt's blocks are cached"
    warm = _run(engine, prompt_ids)
    assert warm.num_cached_tokens == 0 and warm.output_token_ids == plain.output_token_ids
    torch.testing.assert_close(torch.tensor([p.logprob for p in warm.prompt_logprobs]),
                               torch.tensor([p.logprob for p in whole.prompt_logprobs]), rtol=0, atol=1e-5)
    assert [p.top for p in warm.prompt_logprobs] == [p.top for p in _run(build(model_dir, prefill_chunk_tokens=5),
                                                                          prompt_ids).prompt_logprobs]


def test_preemption_records_no_position_twice(model_dir: Path, prompt_ids: list[int]) -> None:
    """Requests growing in a pool too small for them (8 blocks): the prompt-logprobs one is preempted in the
    middle of its prefill, computed again from its first token, and still has one value per prompt token,
    equal to its values alone."""
    alone = _run(build(model_dir), prompt_ids, max_tokens=24)
    engine = build(model_dir, num_kv_blocks=8, max_num_batched_tokens=64, prefill_chunk_tokens=8,
                   enable_prefix_caching=False)
    preempt, recorded_then = engine.scheduler.preempt, []

    def watched(seq) -> None:
        if seq.params.prompt_logprobs is not None:
            recorded_then.append(len(seq.prompt_logprobs))
        preempt(seq)

    engine.scheduler.preempt = watched
    params = SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=3, ignore_eos=True)
    others = [{"prompt_token_ids": prompt_ids[: 20 + i], "params": greedy(24, ignore_eos=True)} for i in range(3)]
    outs = engine.generate([*others, {"prompt_token_ids": prompt_ids, "params": params}])
    assert all(o.error is None for o in outs)
    assert any(0 < n < len(prompt_ids) - 1 for n in recorded_then), recorded_then  # preempted mid-prefill
    got = outs[-1].prompt_logprobs
    assert len(got) == len(prompt_ids) - 1
    torch.testing.assert_close(torch.tensor([p.logprob for p in got]),
                               torch.tensor([p.logprob for p in alone.prompt_logprobs]), rtol=0, atol=1e-5)
    assert outs[-1].output_token_ids == alone.output_token_ids


def test_the_prefill_stage_sends_them_with_its_first_event(model_dir: Path, prompt_ids: list[int], tmp_path: Path) -> None:
    """Disaggregated: prefill computes them and its first event carries them across the hand-off's bytes;
    decode's events carry none."""
    expected = _run(build(model_dir), prompt_ids, max_tokens=4)
    config = EngineConfig(host_kv_blocks=64, host_kv_dir=str(tmp_path / "host"))
    prefill, decode = build_prefill_service(model_dir, config), build_decode_service(model_dir, config)
    engine = build(model_dir)
    request = engine.intake.make_request("p0", SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3),
                                         prompt_token_ids=prompt_ids)[0]

    async def run() -> tuple[Handoff, list]:
        handoff = Handoff.from_msgpack((await prefill.prefill(request)).to_msgpack())
        later = [e async for batch in decode.generate(handoff) for e in batch]
        return handoff, later

    handoff, later = asyncio.run(run())
    assert [p.logprob for p in handoff.first.prompt_logprobs] == [p.logprob for p in expected.prompt_logprobs]
    assert all(e.prompt_logprobs is None for e in later)
    assert [handoff.first.token_id, *[e.token_id for e in later]] == expected.output_token_ids


def test_a_request_without_them_computes_one_row_per_sequence(model_dir: Path, prompt_ids: list[int]) -> None:
    """The batch around a prompt-logprobs request is unchanged: its neighbours' tokens are theirs alone."""
    engine = build(model_dir, prefill_chunk_tokens=16)
    alone = engine.generate([{"prompt_token_ids": prompt_ids[:30], "params": greedy(6)}])[0].output_token_ids
    outs = build(model_dir, prefill_chunk_tokens=16).generate([
        {"prompt_token_ids": prompt_ids[:30], "params": greedy(6)},
        {"prompt_token_ids": prompt_ids, "params": SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0)},
    ])
    assert outs[0].output_token_ids == alone and outs[0].prompt_logprobs is None
    assert len(outs[1].prompt_logprobs) == len(prompt_ids) - 1 and all(p.top == [] for p in outs[1].prompt_logprobs)


def test_a_non_finite_prompt_row_fails_its_own_request_only(model_dir: Path, prompt_ids: list[int],
                                                          monkeypatch) -> None:
    """A NaN in one prompt row of a prompt-logprobs request ends that request with an error event; the
    request batched beside it keeps exactly its tokens, and every block is released."""
    from strata.pipeline.core.model_runner import ModelRunner
    from strata.pipeline.core.prompt_logprobs import logits_rows

    alone = build(model_dir, prefill_chunk_tokens=8).generate(
        [{"prompt_token_ids": prompt_ids[:30], "params": greedy(6)}])[0].output_token_ids
    original = ModelRunner.execute

    def poisoned(self, chunks):
        logits = original(self, chunks).clone()  # an inference tensor: written outside inference mode
        row = 0
        for chunk in chunks:
            n = logits_rows(chunk)
            if chunk.seq.request_id == "bad" and n > 1:
                logits[row + 1] = float("nan")
            row += n
        return logits

    monkeypatch.setattr(ModelRunner, "execute", poisoned)
    engine = build(model_dir, prefill_chunk_tokens=8)
    good = engine.add_request(prompt_token_ids=prompt_ids[:30], params=greedy(6))
    engine.add_request(prompt_token_ids=prompt_ids, request_id="bad",
                       params=SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2))
    events = list(engine.run())
    bad = [e for e in events if e.request_id == "bad"]
    assert len(bad) == 1 and bad[0].finish_reason == "error" and "invalid values" in bad[0].error
    assert [e.token_id for e in events if e.request_id == good] == alone
    assert engine.kv.pool.stats()["in_use"] == 0


def test_a_scored_prompt_runs_in_bounded_chunks(model_dir: Path, prompt_ids: list[int], monkeypatch) -> None:
    """A prompt-logprobs request computes at most ``SCORED_CHUNK_TOKENS`` rows a step, whatever chunk the
    engine is configured with (its logits are [rows, vocab] fp32), and its numbers do not change."""
    import strata.pipeline.core.scheduler as scheduler
    from strata.pipeline.core.model_runner import ModelRunner

    expected = _run(build(model_dir, prefill_chunk_tokens=8), prompt_ids)
    monkeypatch.setattr(scheduler, "SCORED_CHUNK_TOKENS", 16)
    widths: list[int] = []
    original = ModelRunner.execute

    def watched(self, chunks):
        widths.extend(c.num_tokens for c in chunks if c.seq.params.prompt_logprobs is not None)
        return original(self, chunks)

    monkeypatch.setattr(ModelRunner, "execute", watched)
    got = _run(build(model_dir, prefill_chunk_tokens=512), prompt_ids)
    assert max(widths) == 16 and len(widths) >= len(prompt_ids) // 16
    torch.testing.assert_close(torch.tensor([p.logprob for p in got.prompt_logprobs]),
                               torch.tensor([p.logprob for p in expected.prompt_logprobs]), rtol=0, atol=1e-5)

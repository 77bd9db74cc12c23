"""Speculative decoding by prompt lookup: drafts, exact verification, and the engine around them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import SPECULATIVE, build, greedy, preempting_engine, spilling_engine, tokens_through_handoff
from strata.pipeline.contract.config import EngineConfig, SpeculativeConfig
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.sampler import target_probs
from strata.pipeline.core.speculation import NgramProposer, verify

SPEC = SPECULATIVE
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
PROMPTS = ("the cat sat on the mat. the cat sat on the mat. the cat", "one two three one two three one",
           "hello there, how are you", "a b a b a b a b a b")
REWRITE = [{"role": "user", "content": "Rewrite this code exactly, but rename every function to start with my_:\n\n" + CODE}]


def proposer(k: int = 3, n_max: int = 3, n_min: int = 1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=n_max,
                                           prompt_lookup_min=n_min))


def _lookup(p: NgramProposer, tokens: list[int], limit: int) -> list[int]:
    return p.propose(SimpleNamespace(token_ids=tokens, lookup_ids=None), limit)


def test_prompt_lookup_drafts_what_followed_the_latest_match_of_the_longest_suffix() -> None:
    p = proposer()
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert _lookup(p, tokens, 8) == [7, 8, 1]  # suffix 1 2 3: latest earlier match at 5, then what followed
    assert _lookup(p, tokens, 2) == [7, 8]  # never past the request's remaining tokens
    assert _lookup(p, tokens, 0) == []
    assert _lookup(p, [5, 6, 7, 6, 7], 8) == [6, 7]  # 6 7 matched at 1 (overlapping the suffix is fine)
    assert _lookup(p, [4, 5, 6], 8) == []  # nothing earlier matches, and the suffix never matches itself
    assert _lookup(proposer(n_min=3), [1, 2, 9, 8, 2], 8) == []  # only 2-grams would match: below the minimum
    assert _lookup(proposer(n_min=1), [1, 2, 9, 8, 2], 8) == [9, 8, 2]


def _reference_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The definition, one n and one position at a time."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


def test_prompt_lookup_equals_its_definition_on_random_sequences_as_they_grow() -> None:
    """The array kept per sequence grows with it; each step's draft is the definition's."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        n_max = 1 + trial % 5
        p = proposer(k=3, n_max=n_max, n_min=1 + trial % n_max)
        seq = SimpleNamespace(token_ids=[], lookup_ids=None)
        for token in torch.randint(0, 4, (300,), generator=gen).tolist():  # 4 symbols: many matches
            seq.token_ids.append(token)
            assert p.propose(seq, 3) == _reference_lookup(seq.token_ids, 3, p.n_max, p.n_min)


def test_greedy_verification_keeps_the_agreed_prefix_then_the_models_own_token() -> None:
    rows = torch.full((4, 6), -5.0)
    for row, best in enumerate([3, 1, 4, 0]):
        rows[row, best] = 5.0
    params = SamplingParams(temperature=0.0)
    assert verify(rows, [3, 1, 4], params, None) == [3, 1, 4, 0]  # every draft agreed: plus the bonus token
    assert verify(rows, [3, 2, 4], params, None) == [3, 1]  # the second disagreed: the model's token instead
    assert verify(rows, [5, 1, 4], params, None) == [3]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=3),
                                    SamplingParams(temperature=1.2, top_p=0.7)], ids=["temperature", "top-k", "top-p"])
def test_rejection_sampling_keeps_the_targets_distribution(params: SamplingParams) -> None:
    """Each emitted token has exactly the target's distribution whatever the draft: the first token
    against row 0, the second (given the first was the draft) against row 1. 6 sigma bounds, 12K draws."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 1.4, -0.5, 0.3], [1.0, 0.0, 0.0, 0.0, 0.0]])
    probs = target_probs(logits, [params] * 3)
    draft = [1, 2]  # a likely-ish first token, a less likely second
    generator = torch.Generator().manual_seed(7)
    draws = 12000
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(draws):
        out = verify(logits, draft, params, generator)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    for counts, expected in ((first, probs[0]), (second, probs[1])):
        n = counts.sum()
        sigma = (expected * (1 - expected) / n).sqrt().clamp_min(1e-9)
        assert ((counts / n - expected).abs() <= 6 * sigma + 1e-9).all(), (counts / n, expected)
        assert (counts[expected == 0] == 0).all()  # a token top-k/top-p removed is never emitted


def _outputs(engine, requests: list[dict]) -> list[list[int]]:
    return [o.output_token_ids for o in engine.generate(requests)]


@pytest.mark.parametrize("make", ["plain", "preempting", "spilling", "tp2"])
def test_greedy_answers_are_the_same_with_speculation_on_and_off(make: str, llama_dir: Path,
                                                                 tmp_path: Path) -> None:
    """Drafts rejected and accepted alike leave exactly the answers of plain decoding, also when sequences
    are preempted and recomputed, when their older KV lives in the host tier, and in a tp=2 group."""
    model = llama_dir
    requests = [{"prompt": p, "params": greedy(40)} for p in PROMPTS]
    if make == "preempting":  # four prompts of ~3 blocks that grow past the 14-block pool together
        requests = [{"prompt": r["prompt"] * 3, "params": greedy(40)} for r in requests]
        plain, spec = preempting_engine(model), build(model, num_kv_blocks=14, max_num_batched_tokens=64,
                                                          prefill_chunk_tokens=32, enable_prefix_caching=False,
                                                          speculative=SPEC)
    elif make == "spilling":
        requests = [{"prompt": " ".join(["the harbour light"] * 60), "params": greedy(40)}]
        plain = spilling_engine(model, tmp_path / "a")
        spec = build(model, num_kv_blocks=10, prefill_chunk_tokens=32, host_kv_blocks=200,
                     host_kv_dir=str(tmp_path / "b"), speculative=SPEC)
    elif make == "tp2":
        plain, spec = build(model), build(model, speculative=SPEC, tp=2)
    else:
        plain, spec = build(model), build(model, speculative=SPEC)
    try:
        assert _outputs(spec, requests) == _outputs(plain, requests)
    finally:
        if make == "tp2":
            spec.close()
    assert spec.core.speculation.verifications > 0
    if make == "preempting":
        assert spec.scheduler.num_preemptions > 0
    if make == "spilling":
        assert spec.kv.spills.peak > 4


def test_rows_that_speculation_would_change_are_never_drafted(llama_dir: Path) -> None:
    """Logprobs, penalties and min_tokens act per position: such rows decode one token a step (the same
    prompt with plain params does speculate). Rows with a grammar are left out by the same rule."""
    spec = build(llama_dir, speculative=SPEC)
    request = {"prompt": PROMPTS[0], "params": greedy(24, ignore_eos=True)}
    spec.generate([request])
    drafted = spec.core.speculation.verifications
    assert drafted > 0
    for params in (greedy(24, logprobs=2, ignore_eos=True), greedy(24, repetition_penalty=1.3, ignore_eos=True),
                   greedy(24, min_tokens=5, ignore_eos=True)):
        out = spec.generate([{**request, "params": params}])[0]
        assert len(out.output_token_ids) == 24 and spec.core.speculation.verifications == drafted


def test_a_speculating_row_that_goes_bad_fails_alone_and_leaks_no_blocks(llama_dir: Path, monkeypatch) -> None:
    """NaN logits in one row's draft fail that request only; the others answer as without speculation,
    and every block (the draft's reserved slots included) is back in the pool at the end."""
    from strata.pipeline.core.model_runner import ModelRunner

    requests = [{"prompt": p, "params": greedy(24, ignore_eos=True)} for p in PROMPTS]
    want = _outputs(build(llama_dir), requests)
    spec = build(llama_dir, speculative=SPEC)
    original = ModelRunner.execute

    def nan_in_one_draft(self, chunks):
        logits, row = original(self, chunks).clone(), 0
        for chunk in (c for c in chunks if c.samples):
            if chunk.seq.request_id == "bad" and chunk.draft:
                logits[row : row + 1 + len(chunk.draft)] = float("nan")
            row += 1 + len(chunk.draft)
        return logits

    monkeypatch.setattr(ModelRunner, "execute", nan_in_one_draft)
    ids = [spec.add_request(**r) for r in requests[1:]]
    spec.add_request(**requests[0], request_id="bad")
    events = list(spec.run())
    bad = [e for e in events if e.request_id == "bad"]
    assert bad[-1].finish_reason == "error" and "invalid values" in bad[-1].error
    assert [[e.token_id for e in events if e.request_id == i] for i in ids] == want[1:]
    assert spec.kv.pool.stats()["in_use"] == 0


@pytest.fixture(scope="module")
def smollm2_pair(smollm2: Path):
    return build(smollm2), build(smollm2, speculative=SPEC)


def test_a_real_model_rewriting_code_accepts_most_drafts_and_answers_the_same(smollm2_pair) -> None:
    plain, spec = smollm2_pair
    before = spec.core.speculation.to_dict()
    request = [{"messages": REWRITE, "params": greedy(48)}]
    assert _outputs(spec, request) == _outputs(plain, request)
    after = spec.core.speculation.to_dict()
    drafted, accepted = after["drafted"] - before["drafted"], after["accepted"] - before["accepted"]
    verifications = after["verifications"] - before["verifications"]
    assert accepted >= 0.5 * drafted and (accepted + verifications) / verifications >= 2.0, after


def test_a_real_model_speculates_through_the_hand_off(smollm2: Path, smollm2_pair, tmp_path: Path) -> None:
    """Prefilled in one service, decoded with speculation in another (over the host tier): the plain
    engine's answer, first token included."""
    plain, _ = smollm2_pair
    prompt = "Copy this code:\n" + CODE + "\nCopy:\n" + CODE[:30]
    want = plain.generate([{"prompt": prompt, "params": greedy(40)}])[0].output_token_ids
    config = EngineConfig(speculative=SPEC, host_kv_blocks=256, host_kv_dir=str(tmp_path / "host"))
    assert tokens_through_handoff(smollm2, config, plain, [], prompt, greedy(40)) == want


def test_engine_stats_report_speculation(llama_dir: Path) -> None:
    from strata.stages.engine_service import engine_stats

    spec, plain = build(llama_dir, speculative=SPEC), build(llama_dir)
    spec.generate([{"prompt": p, "params": greedy(24, ignore_eos=True)} for p in PROMPTS])
    stats = engine_stats(spec)["speculation"]
    assert stats["verifications"] > 0 and stats["drafted"] >= stats["accepted"] >= 0
    assert "speculation" not in engine_stats(plain)

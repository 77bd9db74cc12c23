"""Sampler and stop-check behaviour: greedy, seeded reproducibility, filtering, distribution, stopping."""

from __future__ import annotations

import pytest
import torch

from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.sampler import Sampler, StopResult, check_stop, make_generator

VOCAB = 50


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3.0


def test_greedy_is_argmax() -> None:
    logits = _logits(4)
    params = [SamplingParams(temperature=0.0)] * 4
    assert Sampler().sample(logits, params, [None] * 4) == logits.argmax(dim=-1).tolist()


def test_greedy_ties_pick_lowest_id() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, [7, 3, 9]] = 5.0
    assert Sampler().sample(logits, [SamplingParams(temperature=0.0)], [None]) == [3]


def _draws(logits: torch.Tensor, params: SamplingParams, steps: int) -> list[int]:
    generator = make_generator(params.seed)
    return [Sampler().sample(logits, [params], [generator])[0] for _ in range(steps)]


def test_seeded_sampling_is_reproducible() -> None:
    logits = _logits(1)
    params = SamplingParams(temperature=1.5, seed=1234)
    first = _draws(logits, params, 20)
    assert first == _draws(logits, params, 20)
    assert len(set(first)) > 1  # actually random, not collapsed to argmax
    assert first != _draws(logits, SamplingParams(temperature=1.5, seed=99), 20)


def test_seeded_sampling_independent_of_batch_composition() -> None:
    target = SamplingParams(temperature=1.2, top_p=0.9, top_k=20, seed=7)
    neighbours = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=2.0, top_k=5),
    ]
    logits = _logits(4, seed=1)
    alone = _draws(logits[2:3], target, 15)

    sampler = Sampler()
    generators = [None, make_generator(3), make_generator(target.seed), None]
    params = [neighbours[0], neighbours[1], target, neighbours[2]]
    batched = [sampler.sample(logits, params, generators)[2] for _ in range(15)]
    assert batched == alone


def test_top_k_one_equals_greedy() -> None:
    logits = _logits(6, seed=2)
    params = [SamplingParams(temperature=1.0, top_k=1, seed=i) for i in range(6)]
    generators = [make_generator(p.seed) for p in params]
    assert Sampler().sample(logits, params, generators) == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_equals_greedy() -> None:
    logits = _logits(6, seed=3)
    params = [SamplingParams(temperature=1.0, top_p=1e-6, seed=i) for i in range(6)]
    generators = [make_generator(p.seed) for p in params]
    assert Sampler().sample(logits, params, generators) == logits.argmax(dim=-1).tolist()


def test_top_k_and_top_p_restrict_support() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    sampler = Sampler()
    top_k = SamplingParams(top_k=2, seed=0)
    top_p = SamplingParams(top_p=0.8, seed=0)  # 0.5 + 0.3 reaches 0.8 -> {0, 1}
    for params in (top_k, top_p):
        generator = make_generator(params.seed)
        seen = {sampler.sample(logits, [params], [generator])[0] for _ in range(300)}
        assert seen == {0, 1}


def test_empirical_distribution_matches_softmax() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20_000
    logits = probs.log().unsqueeze(0).expand(n, -1).contiguous()
    params = [SamplingParams(temperature=1.0)] * n
    generator = make_generator(2024)
    tokens = Sampler().sample(logits, params, [generator] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
    expected = probs.double() * n
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 16.27  # p = 0.001 critical value for 3 degrees of freedom


def test_a_masked_token_is_never_drawn_without_filters() -> None:
    """With no top-k/top-p the draw runs in vocabulary order (no sort): tokens a grammar or a logits
    processor masked (-inf) sit anywhere in it and must never come out, even when a uniform near 1 rounds
    past the last token with mass."""
    from strata.pipeline.core.sampler import _inverse_cdf

    logits = _logits(1, seed=4)
    logits[0, ::3] = float("-inf")
    logits[0, VOCAB - 2 :] = float("-inf")
    generator = make_generator(11)
    masked_by_design = torch.tensor([True])  # as the engine passes a processed row: only the model's NaN is invalid
    drawn = {Sampler().sample(logits, [SamplingParams(temperature=1.0)], [generator], masked_by_design)[0]
             for _ in range(400)}
    assert drawn and all(torch.isfinite(logits[0, t]) for t in drawn)
    assert len(drawn) > 5
    probs = torch.softmax(logits, dim=-1)
    last_with_mass = max(i for i in range(VOCAB) if probs[0, i] > 0)
    assert _inverse_cdf(probs, torch.tensor([1.0])).tolist() == [last_with_mass]


def test_temperature_sharpens_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0]]).expand(4000, -1).contiguous()
    params = [SamplingParams(temperature=0.25)] * 4000
    tokens = Sampler().sample(logits, params, [make_generator(5)] * 4000)
    share = sum(tokens) / len(tokens)  # softmax([0, 4]) -> p(1) ~= 0.982
    assert 0.97 < share < 0.995


def test_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="params"):
        Sampler().sample(_logits(2), [SamplingParams()], [None, None])


def test_make_generator_none_without_seed() -> None:
    assert make_generator(None) is None
    assert isinstance(make_generator(0), torch.Generator)


# ---- stop checks ----------------------------------------------------------------------------------------

EOS = {2}


def test_stop_string_truncates_text() -> None:
    params = SamplingParams(stop=["\n\n", "END"])
    result = check_stop([5, 6, 7], EOS, params, "Hello world END and more")
    assert result == StopResult("stop", "Hello world ", "END")


def test_stop_string_earliest_match_wins() -> None:
    params = SamplingParams(stop=["zz", "b"])
    assert check_stop([5], EOS, params, "a b zz").text == "a "


def test_stop_string_only_searches_new_tail() -> None:
    params = SamplingParams(stop=["STOP"])
    # "STO" was already there; the new "P" completes the match.
    assert check_stop([5, 6], EOS, params, "go STOP", prev_text_len=6).text == "go "
    assert check_stop([5, 6], EOS, params, "xx yy", prev_text_len=3).finish_reason is None


def test_eos_stops_unless_ignored() -> None:
    assert check_stop([5, 2], EOS, SamplingParams(), "hi").finish_reason == "stop"
    assert check_stop([5, 2], EOS, SamplingParams(ignore_eos=True), "hi").finish_reason is None


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    params = SamplingParams(stop_token_ids=[9], ignore_eos=True)
    assert check_stop([5, 9], EOS, params, "hi") == StopResult("stop", "hi", 9)


def test_max_tokens_gives_length() -> None:
    params = SamplingParams(max_tokens=3)
    assert check_stop([5, 6], EOS, params, "ab").finish_reason is None
    assert check_stop([5, 6, 7], EOS, params, "abc") == StopResult("length", "abc")
    # eos on the last allowed token is reported as a natural stop
    assert check_stop([5, 6, 2], EOS, params, "ab").finish_reason == "stop"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_validate_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate()


def test_validate_accepts_defaults_and_greedy_flag() -> None:
    SamplingParams().validate()
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams().greedy

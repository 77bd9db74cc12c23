"""Penalties, logit_bias and min_tokens in the batched step, each against a reference computed
independently: transformers' own logits processors where one exists (repetition penalty, sequence bias,
minimum new tokens), a plain per-token loop for OpenAI's frequency and presence penalties; then whole
generations against transformers' generate with the same settings, in a batch whose other rows ask for
nothing (and are untouched)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import build, greedy

from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.logits_processors import apply_logits_processors

VOCAB = 50
EOS = (1, 7)


def _seq(prompt: list[int], output: list[int], **params) -> SimpleNamespace:
    return SimpleNamespace(token_ids=prompt + output, num_prompt_tokens=len(prompt), token_counts=None,
                           params=SamplingParams(max_tokens=64, **params))


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_equals_transformers_and_leaves_other_rows_alone() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    seqs = [_seq([3, 4, 5], [9, 9, 12], repetition_penalty=1.3), _seq([3, 8], [2], repetition_penalty=0.7),
            _seq([3, 4], [9])]
    logits = _logits(3)
    out = apply_logits_processors(logits, seqs, EOS)
    for i, p in ((0, 1.3), (1, 0.7)):
        ref = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([seqs[i].token_ids]), logits[i : i + 1].clone())
        torch.testing.assert_close(out[i], ref[0], rtol=0, atol=0)
    assert torch.equal(out[2], logits[2])  # asked for nothing


def test_frequency_and_presence_penalties_equal_a_per_token_loop() -> None:
    """OpenAI's definition: logit[t] -= count[t] * frequency + (count[t] > 0) * presence, output tokens only
    (the prompt's repeats are not penalised)."""
    seq = _seq([9, 9, 9, 4], [9, 12, 12, 12, 30], frequency_penalty=0.5, presence_penalty=-0.25)
    logits = _logits(1, 1)
    out = apply_logits_processors(logits, [seq], EOS)
    expected = logits[0].clone()
    output = seq.token_ids[seq.num_prompt_tokens:]
    for token in set(output):
        expected[token] -= output.count(token) * 0.5 + 1 * -0.25
    torch.testing.assert_close(out[0], expected, rtol=0, atol=1e-6)
    seq.token_ids.append(4)  # the next step counts only the new token: 4 now appears in the output too
    again = apply_logits_processors(logits, [seq], EOS)
    torch.testing.assert_close(again[0, 4], logits[0, 4] - 0.25, rtol=0, atol=1e-6)


def test_logit_bias_and_min_tokens_equal_transformers() -> None:
    from transformers import MinNewTokensLengthLogitsProcessor, SequenceBiasLogitsProcessor

    prompt = [3, 4, 5, 6]
    seq = _seq(prompt, [11], logit_bias={8: 5.0, 20: -100.0}, min_tokens=3, stop_token_ids=[13])
    logits = _logits(1, 2)
    out = apply_logits_processors(logits, [seq], EOS)
    ids = torch.tensor([seq.token_ids])
    ref = SequenceBiasLogitsProcessor({(8,): 5.0, (20,): -100.0})(ids, logits.clone())
    ref = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [*EOS, 13])(ids, ref)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    done = _seq(prompt, [11, 12, 14], min_tokens=3)  # three tokens out: eos allowed again
    assert torch.isfinite(apply_logits_processors(logits, [done], EOS)[0, list(EOS)]).all()


def test_bad_settings_are_refused_by_name() -> None:
    for kwargs, message in (({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0.0}, "repetition"),
                            ({"logit_bias": {3: 101.0}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
                            ({"min_tokens": -1}, "min_tokens")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs).validate()


def _hf_generate(model_dir, prompt: str, n: int, **kwargs) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                      add_generation_prompt=True))["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kwargs)
    return out[0, len(ids):].tolist()


def test_generations_equal_transformers_generate_with_the_same_settings(text_models) -> None:
    """Greedy with a repetition penalty, a sequence bias, and a minimum length, each next to a plain greedy
    request in the same batch (which still equals transformers' plain greedy)."""
    model_dir = text_models["qwen2"]
    engine = build(model_dir, prefill_chunk_tokens=8)
    prompt = "Tell me about the sea and the sea and the sea."
    eos = list(engine.tokenizer.eos_token_ids)
    plain = _hf_generate(model_dir, prompt, 12, eos_token_id=None)
    biased_token = plain[3]
    cases = [
        (greedy(12, ignore_eos=True, repetition_penalty=1.5), dict(repetition_penalty=1.5, eos_token_id=None)),
        (greedy(12, ignore_eos=True, logit_bias={biased_token: -100.0}),
         dict(sequence_bias={(biased_token,): -100.0}, eos_token_id=None)),
        (greedy(12, min_tokens=12), dict(min_new_tokens=12, eos_token_id=eos)),
    ]
    for params, hf in cases:
        outs = engine.generate([{"prompt": prompt, "params": params},
                                {"prompt": prompt, "params": greedy(12, ignore_eos=True)}])
        assert outs[0].output_token_ids == _hf_generate(model_dir, prompt, 12, **hf), params
        assert outs[1].output_token_ids == plain
    assert biased_token not in engine.generate([{"prompt": prompt, "params": cases[1][0]}])[0].output_token_ids
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3, min_tokens=12)  # -inf entries, then sampling
    out = engine.generate([{"prompt": prompt, "params": sampled}])[0]
    assert out.error is None and len(out.output_token_ids) == 12 and not set(out.output_token_ids[:-1]) & set(eos)

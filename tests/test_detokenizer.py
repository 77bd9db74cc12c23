"""Incremental detokenization gives exactly the text of a full decode, token by token."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from strata.pipeline.frontend.detokenizer import IncrementalDetokenizer


def test_incremental_equals_full_decode(llama_dir) -> None:
    tok = AutoTokenizer.from_pretrained(llama_dir)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    rng = random.Random(0)
    texts = ["Hello wörld — ünïcödé ✓ 日本語 🙂 done.", "plain ascii text, with punctuation!"]
    samples = [tok(t)["input_ids"] for t in texts]
    samples += [[rng.randrange(len(tok)) for _ in range(60)] for _ in range(20)]  # random byte pieces
    for ids in samples:
        detok = IncrementalDetokenizer()
        text = ""
        for n in range(1, len(ids) + 1):
            text += detok.step(decode, ids[:n])
        text += detok.step(decode, ids, final=True)
        assert text == decode(ids)


def test_the_fast_decode_equals_the_tokenizers_decode(llama_dir) -> None:
    """PromptTokenizer.decode skips the Python wrapper; the text must not change."""
    from strata.pipeline.frontend.tokenizer import PromptTokenizer
    from strata.pipeline.models.model_config import load_model_config

    tok = PromptTokenizer(llama_dir, load_model_config(llama_dir))
    assert tok._backend is not None  # the fast path is what this test covers
    rng = random.Random(1)
    vocab = len(tok.tokenizer)
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        assert tok.decode(ids) == tok.tokenizer.decode(ids, skip_special_tokens=True)

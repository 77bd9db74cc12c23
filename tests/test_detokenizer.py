"""Incremental detokenization gives exactly the text of a full decode, token by token."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from strata.pipeline.detokenizer import IncrementalDetokenizer


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

"""`strata.LLM`, the offline API in vLLM's shape: a chat answers what transformers answers (real SmolLM2 weights),
``generate`` takes prompts as they are (no chat template) in vLLM's forms (a string, ``prompt_token_ids``,
``multi_modal_data`` images as PIL images), one SamplingParams or one per prompt; a batch with a prompt that
cannot run is a ValueError naming it and leaves nothing queued; a misspelled engine argument is named."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image
from transformers import AutoTokenizer

import strata
from helpers import build, transformers_reference
from strata.checkpoints.tiny_model import IMAGE


@pytest.fixture(scope="module")
def llm(smollm2: Path):
    with strata.LLM(smollm2, max_model_len=2048) as llm:
        yield llm


def test_a_chat_answers_as_transformers_does(llm, smollm2: Path) -> None:
    question = "What is the capital of France?"
    expected, _ = transformers_reference(smollm2, question, 10)
    (out,) = llm.chat([{"role": "user", "content": question}],
                      strata.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].text == tok.decode(expected, skip_special_tokens=True)
    assert out.outputs[0].finish_reason == "length" and out.error is None
    assert out.prompt_token_ids == tok.apply_chat_template([{"role": "user", "content": question}],
                                                           add_generation_prompt=True, tokenize=True)["input_ids"]


def test_generate_takes_prompts_as_they_are(llm, smollm2: Path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2)
    text = "The capital of France is"
    ids = tok(text)["input_ids"]
    greedy = strata.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    by_text, by_ids = llm.generate([text, {"prompt_token_ids": ids}], greedy)
    assert by_text.prompt == text and by_text.prompt_token_ids == ids  # no chat template
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids and len(by_ids.outputs[0].token_ids) == 6
    (alone,) = llm.generate(text, greedy)  # one prompt: a list of one
    assert alone.outputs[0].token_ids == by_text.outputs[0].token_ids
    short, longer = llm.generate([text, text], [strata.SamplingParams(max_tokens=2, temperature=0), greedy])
    assert short.outputs[0].token_ids == by_text.outputs[0].token_ids[:2] and longer.outputs[0].token_ids == \
        by_text.outputs[0].token_ids
    with pytest.raises(ValueError, match="1 sampling params for 2 prompts"):
        llm.generate([text, text], [greedy])


def test_a_batch_with_a_prompt_that_cannot_run_is_refused_whole(llm) -> None:
    with pytest.raises(ValueError, match="^prompt 1: .*max_model_len 2048"):
        llm.generate(["Hello", "word " * 5000], strata.SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()  # the first prompt did not stay queued
    for bad, message in (({"prompt": "a", "prompt_token_ids": [1]}, "exactly one of prompt and prompt_token_ids"),
                         ({"text": "a"}, "unknown prompt key 'text'"),
                         ({"prompt": "a", "multi_modal_data": {"audio": b""}}, "images only, got 'audio'"),
                         (7, "a string or a dict, got int")):
        with pytest.raises(ValueError, match=message):
            llm.generate(["fine", bad])
        assert not llm.engine.has_unfinished()
    (out,) = llm.generate("Hello", strata.SamplingParams(max_tokens=3, temperature=0))
    assert len(out.outputs[0].token_ids) <= 3


def test_images_go_with_the_placeholders_of_the_prompt(llama_dir: Path, demo_images: list[bytes]) -> None:
    prompt = f"USER: {IMAGE}\nWhat is in the picture? ASSISTANT:"
    greedy = strata.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with strata.LLM(llama_dir) as llm:
        (out,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": Image.open(io.BytesIO(demo_images[0]))}},
                              greedy)
    expected = build(llama_dir).generate([{"raw_prompt": prompt, "images": [demo_images[0]], "params": greedy}])[0]
    assert out.outputs[0].token_ids == expected.output_token_ids  # the PNG of the decoded image is the same image
    assert len(out.prompt_token_ids) == expected.num_prompt_tokens


def test_a_misspelled_engine_argument_is_named_before_anything_loads(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^unknown engine argument max_model_lenn$"):
        strata.LLM(tmp_path / "nothing-here", max_model_lenn=4096)
    with pytest.raises(ValueError, match="^engine argument dtype: "):
        strata.LLM(tmp_path / "nothing-here", dtype="float64")

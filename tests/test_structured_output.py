"""Structured output in the engine: a JSON schema, a regex, a choice and a Lark grammar constrain the
tokens (greedy and sampled), answers parse and validate, a max_tokens cut is a `length` finish, bad
specifications are refused by name before admission, and constrained rows leave the others of their
batch untouched; the grammar's state survives preemption and a hand-off."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from helpers import build, greedy, preempting_engine

from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.frontend.structured import spec_from_openai

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "n", "color"], "additionalProperties": False}
JSON = ("json", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def engine(text_models):
    return build(text_models["qwen2"])


def _run(engine, params: SamplingParams, prompt: str = "Give me JSON") -> object:
    return engine.generate([{"prompt": prompt, "params": params}])[0]


@pytest.mark.parametrize("params", [greedy(40, structured=JSON),
                                    SamplingParams(max_tokens=40, temperature=1.0, seed=5, structured=JSON)],
                         ids=["greedy", "sampled"])
def test_a_json_schema_answer_parses_and_validates(engine, params: SamplingParams) -> None:
    out = _run(engine, params)
    assert out.finish_reason == "stop" and out.error is None
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_choice_and_grammar_constrain_the_answer(engine) -> None:
    assert re.fullmatch(r"[a-c]{3}-\d{2}", _run(engine, greedy(20, structured=("regex", r"[a-c]{3}-\d{2}"))).text)
    assert _run(engine, greedy(20, structured=("choice", json.dumps(["yes", "no", "maybe"])))).text in \
        ("yes", "no", "maybe")
    lark = 'start: "sum(" NUM "," NUM ")"\nNUM: /[0-9]{1,3}/'
    assert re.fullmatch(r"sum\(\d{1,3},\d{1,3}\)", _run(engine, greedy(20, structured=("lark", lark))).text)


def test_a_cut_answer_finishes_with_length_and_the_batch_is_untouched(engine) -> None:
    cut = _run(engine, greedy(3, structured=JSON))
    assert cut.finish_reason == "length" and cut.text.startswith("{")
    alone = _run(engine, greedy(12, ignore_eos=True), "Tell me about the sea.")
    mixed = engine.generate([{"prompt": "Tell me about the sea.", "params": greedy(12, ignore_eos=True)},
                             {"prompt": "Give me JSON", "params": greedy(40, structured=JSON)}])
    assert mixed[0].output_token_ids == alone.output_token_ids
    jsonschema.validate(json.loads(mixed[1].text), SCHEMA)


def test_the_grammar_state_survives_preemption(text_models) -> None:
    requests = [{"prompt": f"Record {i}: give me JSON about the sea and the ships", "params": greedy(40, structured=JSON)}
                for i in range(4)]
    roomy = build(text_models["qwen2"])
    alone = [roomy.generate([r])[0].text for r in requests]
    engine = preempting_engine(text_models["qwen2"])
    outs = engine.generate(requests)
    assert [o.text for o in outs] == alone and engine.scheduler.num_preemptions > 0
    for o in outs:
        jsonschema.validate(json.loads(o.text), SCHEMA)


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "intt"}}}},
     "invalid JSON schema"),
    ({"guided_regex": "(abc"}, "invalid regex"),
    ({"guided_choice": []}, "non-empty list"),
    ({"guided_grammar": "start: ("}, "invalid grammar"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "one structured output constraint"),
])
def test_bad_specifications_are_refused_by_name_before_admission(engine, body: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec = spec_from_openai(body)
        engine.add_request("hi", params=greedy(4, structured=spec))
    assert not engine.has_unfinished()


def test_openai_and_vllm_spellings_mean_the_same(engine) -> None:
    assert spec_from_openai({"response_format": {"type": "json_object"}}) == ("json", '{"type": "object"}')
    as_schema = spec_from_openai({"response_format": {"type": "json_schema", "json_schema": {"name": "r",
                                                                                             "schema": SCHEMA}}})
    assert as_schema == spec_from_openai({"guided_json": SCHEMA}) == spec_from_openai({"structured_outputs":
                                                                                       {"json": SCHEMA}})
    assert spec_from_openai({"response_format": {"type": "text"}}) is None

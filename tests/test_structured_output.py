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


# ---------------------------------------------------------------- the edges: only the grammar says stop
def _token(engine, text: str) -> int:
    (tid,) = engine.tokenizer.tokenizer.encode(text, add_special_tokens=False)
    return tid


def test_a_grammar_error_mid_answer_fails_that_row_alone(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """llguidance's row limit, lowered in the engine (the front door's sandbox keeps its own): the grammar
    compiles and its first mask is fine, then the row after "xyzzy " holds 6 items, past 4. That row ends
    with an error, never a stop; the rows batched with it keep their tokens."""
    from llguidance import LLParserLimits

    monkeypatch.setattr("strata.pipeline.core.grammar.parser_limits", lambda: LLParserLimits(max_items_in_row=4))
    lark = 'start: "xyzzy " item\nitem: "alpha" | "beta" | "gamma" | "delta" | "epsilon"'
    plain = [{"prompt": f"Tell me about the sea {i}.", "params": greedy(16, ignore_eos=True)} for i in range(3)]
    alone = [engine.generate([p])[0].output_token_ids for p in plain]
    outs = engine.generate([*plain, {"prompt": "Pick one", "params": greedy(20, structured=("lark", lark))}])
    assert [o.output_token_ids for o in outs[:3]] == alone
    assert outs[3].finish_reason == "error" and "could not be followed" in outs[3].error


def test_a_stop_token_the_grammar_needs_is_content_and_min_tokens_yields_to_it(engine) -> None:
    """regex "a" whose only token is also a stop token, with min_tokens 3: the token is the grammar's content
    (its language is not complete before it), so the answer is "a", a clean stop, sampled or greedy, and
    the streams beside it are untouched."""
    a = _token(engine, "a")
    plain = [{"prompt": f"Tell me about the sea {i}.", "params": greedy(16, ignore_eos=True)} for i in range(3)]
    alone = [engine.generate([p])[0].output_token_ids for p in plain]
    for params in (SamplingParams(max_tokens=8, temperature=1.0, seed=3, min_tokens=3, stop_token_ids=[a],
                                  structured=("regex", "a")),
                   greedy(8, min_tokens=3, stop_token_ids=[a], structured=("regex", "a"))):
        outs = engine.generate([*plain, {"prompt": "Say a", "params": params}])
        assert (outs[3].finish_reason, outs[3].text, outs[3].error) == ("stop", "a", None)
        assert [o.output_token_ids for o in outs[:3]] == alone


def test_a_stop_token_ends_the_answer_only_where_the_grammar_is_complete(engine) -> None:
    """(ab)+ with "a" as a stop token, pushed up by a bias: the first "a" is content (nothing is complete
    yet), the second, after "ab", ends the answer there."""
    a, b = _token(engine, "a"), _token(engine, "b")
    out = _run(engine, greedy(12, stop_token_ids=[a], logit_bias={a: 100.0, b: 50.0}, structured=("regex", "(ab)+")))
    assert (out.finish_reason, out.text) == ("stop", "ab")


def test_thousands_of_choices_give_one_of_them(engine) -> None:
    choices = [f"choice {i}" for i in range(2500)]
    for seed in range(3):
        out = _run(engine, SamplingParams(max_tokens=12, temperature=1.0, seed=seed,
                                          structured=("choice", json.dumps(choices))))
        assert out.finish_reason == "stop" and out.text in choices


def test_a_grammar_compiles_off_the_step_loop(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar whose compile takes 1.5 s (slowed here; a cold vocabulary costs that for real): the
    constrained request waits in its place while a plain one runs to the end with no step slower than 0.3 s."""
    import time

    from strata.pipeline.core.grammar import GrammarRunner

    compile_ = GrammarRunner._compile
    monkeypatch.setattr(GrammarRunner, "_compile", lambda self, spec: (time.sleep(1.5), compile_(self, spec))[1])
    spec = ("regex", "[a-c]{3}-[0-9]{4}")
    slow = engine.add_request("Give me a code", params=greedy(12, structured=spec))
    fast = engine.add_request("Tell me about the sea.", params=greedy(24, ignore_eos=True))
    seen: list[tuple[str, float]] = []
    for event in engine.run():
        seen.append((event.request_id, time.monotonic()))
    fast_times = [t for rid, t in seen if rid == fast]
    first_slow = next(t for rid, t in seen if rid == slow)
    assert len(fast_times) == 24 and fast_times[-1] < first_slow  # it finished while the grammar compiled
    assert max(b - a for a, b in zip(fast_times, fast_times[1:])) < 0.3


LANGUAGES = {  # kind -> (spec, is this text in the language?)
    "json_schema": (JSON, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    "json_object": (("json", '{"type": "object"}'), lambda t: isinstance(json.loads(t), dict)),
    "regex": (("regex", r"[a-c]{2,4}-\d{1,2}"), lambda t: re.fullmatch(r"[a-c]{2,4}-\d{1,2}", t) is not None),
    "choice": (("choice", json.dumps(["red", "green", "blue"])), lambda t: t in ("red", "green", "blue")),
    "lark": (("lark", 'start: "sum(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'),
             lambda t: re.fullmatch(r"sum\(\d{1,2}(,\d{1,2})*\)", t) is not None),
}


@pytest.mark.parametrize("kind", list(LANGUAGES))
def test_every_stop_is_in_the_language(engine, kind: str) -> None:
    """Temperature 1, eight seeds, room to finish and too little room: every answer that ends with ``stop``
    parses and is in its language; one cut short ends with ``length``, never ``stop``."""
    spec, ok = LANGUAGES[kind]
    outs = engine.generate([{"prompt": f"Answer {seed}", "params": SamplingParams(
        max_tokens=48, temperature=1.0, seed=seed, structured=spec)} for seed in range(8)])
    stops = [o.text for o in outs if o.finish_reason == "stop"]
    assert stops and all(ok(t) for t in stops), [(o.finish_reason, o.text) for o in outs]
    assert {o.finish_reason for o in outs} <= {"stop", "length"}
    cut = engine.generate([{"prompt": "Answer", "params": SamplingParams(max_tokens=2, temperature=1.0, seed=seed,
                                                                         structured=spec)} for seed in range(4)])
    for o in cut:
        assert o.finish_reason == "length" or ok(o.text), (o.finish_reason, o.text)


def test_every_stop_of_a_tool_call_parses_and_satisfies_its_schema(tmp_path) -> None:
    """Tools (required, Hermes) at temperature 1 over eight seeds, including a stop token that is part of the
    call's syntax and min_tokens past the call's length: each answer is calls to declared functions whose
    arguments satisfy their schemas, or a ``length`` cut."""
    from strata.pipeline.frontend.tools.calls import constrain
    from strata.pipeline.frontend.tools.formats import Hermes
    from strata.pipeline.frontend.tools.request import tool_request
    from strata.checkpoints.tiny_text_models import build_tiny_text_model

    engine = build(build_tiny_text_model("qwen2", tmp_path / "hermes", tool_format="hermes"))
    fmt = Hermes(engine.tokenizer.tokenizer)
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
              "additionalProperties": False}
    req = tool_request([{"type": "function", "function": {"name": "get_weather", "parameters": schema}}], "required", None)
    brace = _token(engine, "}")
    outs = []
    for seed in range(8):
        params = SamplingParams(max_tokens=64, temperature=1.0, seed=seed, skip_special_tokens=False,
                                **({"stop_token_ids": [brace], "min_tokens": 60} if seed % 2 else {}))
        constrain(params, req, fmt)
        outs.append(engine.generate([{"prompt": "Weather?", "params": params}])[0])
    assert {o.finish_reason for o in outs} <= {"stop", "length"}, [(o.finish_reason, o.error) for o in outs]
    stops = [o for o in outs if o.finish_reason == "stop"]
    assert stops
    for o in stops:
        calls = fmt.parse(o.text, final=True).calls
        assert calls and all(c.name == "get_weather" for c in calls), o.text
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), schema)

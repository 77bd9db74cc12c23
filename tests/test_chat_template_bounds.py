"""A chat template's render is bounded (``frontend.template_bounds``): a recursive macro, a loop that runs
too long, output past the budget, a range jinja's sandbox refuses and a template that raises are each a
ValueError (an HTTP 400) for that request, within its deadline; a template that renders normally gives
exactly transformers' text, bounds or not."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.frontend.intake import Intake
from strata.pipeline.frontend.template_bounds import TemplateBoundError
from strata.pipeline.frontend.tokenizer import PromptTokenizer
from strata.pipeline.models.model_config import load_model_config

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Tell me about tides."}]
BAD = {
    "recursion": ("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", "recursed too deeply"),
    "slow": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took longer than 0.5 s"),
    "huge": ("{% for i in range(100000) %}{% for j in range(1000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
             "wrote more than 2000 characters"),
    "growing": ("{% set ns = namespace(s='') %}{% for i in range(100000) %}{% set ns.s = ns.s ~ 'xxxxxxxxxxxxxxxx' %}"
                "{% endfor %}{{ ns.s }}", "took longer than 0.5 s"),
    "range": ("{% for i in range(10**10) %}x{% endfor %}", "cannot render these messages: Range too big"),
    "raises": ("{{ raise_exception('roles must alternate') }}", "cannot render these messages: roles must alternate"),
}


@pytest.fixture(scope="module")
def model(text_models: dict[str, Path]) -> Path:
    return text_models["llama"]


@pytest.mark.parametrize("name", list(BAD))
def test_a_template_past_a_bound_is_a_400_within_its_deadline(model: Path, name: str) -> None:
    template, message = BAD[name]
    tok = PromptTokenizer(model, load_model_config(model), template)
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        tok.render_chat(CHAT, timeout_s=0.5, max_chars=2000)
    assert time.monotonic() - start < 3.0


def test_a_bound_is_named_as_such_and_intake_applies_the_configured_one(model: Path) -> None:
    tok = PromptTokenizer(model, load_model_config(model), BAD["slow"][0])
    with pytest.raises(TemplateBoundError):
        tok.render_chat(CHAT, timeout_s=0.2)
    intake = Intake(tok, EngineConfig(chat_template_timeout_s=0.3))
    start = time.monotonic()
    with pytest.raises(ValueError, match="took longer than 0.3 s"):
        intake.make_request("r", SamplingParams(max_tokens=4), messages=CHAT)
    assert time.monotonic() - start < 3.0


def test_a_normal_render_is_transformers_own_text(model: Path) -> None:
    tok = PromptTokenizer(model, load_model_config(model))
    expected = tok.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tok.render_chat(CHAT) == expected
    tok.check_template()  # and it passes the start-up probe


def test_a_requests_template_variables_reach_the_template_and_cannot_set_its_own_parameters(model: Path) -> None:
    """vLLM's ``chat_template_kwargs``: Qwen3's ``enable_thinking`` switched off renders the empty thinking
    block the template writes for it; a variable named after one of ``apply_chat_template``'s own parameters,
    or not a name, is refused before rendering."""
    from strata.pipeline.frontend.intake import Intake
    from strata.pipeline.contract.config import EngineConfig
    from strata.pipeline.contract.sampling_params import SamplingParams

    thinking = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
                "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")
    tok = PromptTokenizer(model, load_model_config(model), thinking)
    assert tok.render_chat(CHAT).endswith("assistant:")
    assert tok.render_chat(CHAT, template_kwargs={"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    for bad, words in (({"add_generation_prompt": False}, "set by the request itself"), ({"a-b": 1}, "not a template")):
        with pytest.raises(ValueError, match=words):
            tok.render_chat(CHAT, template_kwargs=bad)
    intake = Intake(tok, EngineConfig())
    on = intake.make_request("a", SamplingParams(max_tokens=4), messages=CHAT)[0]
    off = intake.make_request("b", SamplingParams(max_tokens=4), messages=CHAT, template_kwargs={"enable_thinking": False})[0]
    assert len(off.prompt_token_ids) > len(on.prompt_token_ids)

"""The grammar sandbox (``frontend.grammar_sandbox``): the front door's child process that compiles each new
spec against the model's vocabulary. A spec that compiles passes once and is remembered; one llguidance
refuses at its first mask is a 400 with llguidance's reason; a child that crashes (a real SIGSEGV, at the
fault point ``grammar_crash``) or hangs past the deadline (``grammar_hang``) costs only that spec, which is
refused from then on without another crash, and the next spec gets a fresh child. The child imports neither
torch nor transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_python

from strata.pipeline.frontend.grammar_sandbox import GrammarRefused, GrammarSandbox
from strata.pipeline.frontend.structured import tokenizer_spec


@pytest.fixture(scope="module")
def hf_tokenizer(text_models: dict[str, Path]):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(text_models["qwen2"])


@pytest.fixture
def sandbox(hf_tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("STRATA_FAULT_DIR", str(tmp_path))  # the child reads its fault points from here
    box = GrammarSandbox(lambda: tokenizer_spec(hf_tokenizer), len(hf_tokenizer), timeout_s=3.0)
    box.faults = tmp_path
    yield box
    box.close()


def _arm(box: GrammarSandbox, point: str) -> None:
    (box.faults / f"{point}.rank0").write_text("1")


def test_a_spec_compiles_once_and_is_remembered(sandbox: GrammarSandbox) -> None:
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
    sandbox.check("json", schema)
    sandbox.check("json", schema)
    assert sandbox.compiled == 1  # the second answer came from the verdicts, not the child


def test_a_grammar_refused_at_its_first_mask_is_a_400_with_the_reason(sandbox: GrammarSandbox) -> None:
    with pytest.raises(GrammarRefused, match="invalid grammar"):
        sandbox.check("lark", "start: missing_rule")
    with pytest.raises(GrammarRefused):  # left recursion with no way out: nothing to write
        sandbox.check("lark", 'start: a\na: a "x"')
    assert sandbox.refused == 2 and sandbox.crashes == 0


def test_a_crash_costs_only_its_spec_and_is_not_repeated(sandbox: GrammarSandbox) -> None:
    sandbox.check("regex", "[0-9]{2}")
    first = sandbox.pid
    _arm(sandbox, "grammar_crash")
    with pytest.raises(GrammarRefused, match="too large or too deep to compile"):
        sandbox.check("regex", "[a-f]{3}")
    assert sandbox.crashes == 1 and sandbox.pid is None
    with pytest.raises(GrammarRefused, match="too large or too deep"):  # remembered: no second crash
        sandbox.check("regex", "[a-f]{3}")
    assert sandbox.crashes == 1
    sandbox.check("regex", "[g-k]{3}")  # a fresh child for the next spec
    assert sandbox.pid is not None and sandbox.pid != first


def test_a_hang_meets_the_deadline_and_the_next_spec_compiles(sandbox: GrammarSandbox) -> None:
    import time

    _arm(sandbox, "grammar_hang")
    start = time.monotonic()
    with pytest.raises(GrammarRefused, match="did not compile within 3 s"):
        sandbox.check("regex", "[a-z]{2}")
    assert time.monotonic() - start < 6 and sandbox.timeouts == 1
    sandbox.check("regex", "[a-z]{4}")


def test_the_sandbox_imports_neither_torch_nor_transformers() -> None:
    out = run_python("-c", "import sys, strata.pipeline.frontend.grammar_worker, strata.pipeline.frontend.structured;"
                           "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr

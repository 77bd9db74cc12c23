"""A tensor-parallel step that fails on one rank, in-process (the driver here, rank 1 a child process).

The defect these guard against: when the driver's forward raised mid-step, the engine core re-ran each
chunk alone, and each re-run broadcast a new step command while the worker still sat in the old step's
all-reduce; the shared-memory channel paired operations by number only, so the command's bytes were
summed into the worker's activations - wrong answers, silently. A worker whose loop raised left the
driver waiting 60 s. Faults are armed with ``STRATA_FAULT_DIR`` files (``pipeline.fault_points``), which
reach the worker process too.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from helpers import build, greedy

pytestmark = pytest.mark.slow  # every test forms a group with a child process

PROMPTS = ["Describe the picture.", "Tell me a long story about a lighthouse keeper.", "Count from one to ten.",
           "Why is the sky blue?"]


def _requests(max_tokens: int = 10) -> list[dict]:
    return [{"prompt": p, "params": greedy(max_tokens + i)} for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> list[list[int]]:
    return [o.output_token_ids for o in build(llama_dir).generate(_requests())]


@pytest.fixture()
def faults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "faults"
    root.mkdir()
    monkeypatch.setenv("STRATA_FAULT_DIR", str(root))  # before the group starts: its worker inherits it
    return root


def _arm(faults: Path, point: str, rank: int, times: int = 1) -> Path:
    path = faults / f"{point}.rank{rank}"
    path.write_text(str(times))
    return path


@pytest.mark.parametrize("rank", [0, 1], ids=["driver", "worker"])
def test_a_step_failing_on_one_rank_is_abandoned_by_all_and_gives_the_right_tokens(
        rank: int, llama_dir: Path, expected, faults: Path) -> None:
    e = build(llama_dir, tp=2)
    try:
        group = e.core.runner.group
        armed = _arm(faults, "tp_layer", rank)  # between a layer's two all-reduces, once
        outs = e.generate(_requests())
        assert not armed.exists(), "the fault fired"
        assert group.abandoned_steps == 1 and group.broken is None
        assert [o.error for o in outs] == [None] * len(outs)
        assert [o.output_token_ids for o in outs] == expected, "the retried step computed exactly tp=1's tokens"
        assert [o.output_token_ids for o in e.generate(_requests())] == expected
        assert e.healthy()
    finally:
        e.close()


def test_a_step_that_keeps_failing_fails_its_requests_promptly_and_the_group_recovers(
        llama_dir: Path, expected, faults: Path) -> None:
    e = build(llama_dir, tp=2)
    try:
        armed = _arm(faults, "tp_layer", 1, times=1000)
        t0 = time.monotonic()
        outs = e.generate(_requests())
        assert time.monotonic() - t0 < 30
        assert all(o.finish_reason == "error" and "internal error" in (o.error or "") for o in outs), outs
        armed.unlink()
        assert e.healthy(), "every failed step was abandoned in step: the group is whole"
        assert [o.output_token_ids for o in e.generate(_requests())] == expected
    finally:
        e.close()


def test_a_worker_whose_loop_dies_fails_the_driver_at_once(llama_dir: Path, faults: Path) -> None:
    e = build(llama_dir, tp=2)
    try:
        assert e.generate([{"prompt": "hi", "params": greedy(4)}])[0].error is None
        _arm(faults, "tp_command", 1)  # the worker's command loop raises: it leaves the group
        t0 = time.monotonic()
        out = e.generate([{"prompt": "hi again", "params": greedy(4)}])[0]
        assert out.finish_reason == "error" and "internal error" in (out.error or "")
        assert time.monotonic() - t0 < 5, "the gone mark, not a 60 s collective timeout"
        assert not e.healthy()
    finally:
        t0 = time.monotonic()
        e.close()
        assert time.monotonic() - t0 < 15

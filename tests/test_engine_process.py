"""The engine core in its own process (no Ray): the tokens of the in-process engine, aborts that free
KV, a child killed mid-stream fails its streams at once, a replica killed takes its child with it, and a
model that will not load is a one-line error."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from helpers import build, greedy
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.request import Request
from strata.stages.engine_process import ENGINE_GONE, EngineProcess, EngineProcessError

pytestmark = pytest.mark.slow  # child processes loading the model

PROMPTS = ["Tell me about the sea.", "Count to ten, slowly.", "Describe a quiet harbour at dawn."]


def _requests(engine, max_tokens: int = 10) -> list[Request]:
    return [engine.prepare(f"r{i}", greedy(max_tokens), [], prompt=p) for i, p in enumerate(PROMPTS)]


async def _collect(proc: EngineProcess, request: Request) -> list:
    return [ev async for batch in proc.generate(request) for ev in batch]


def test_the_child_gives_the_in_process_tokens_and_frees_aborted_kv(llama_dir: Path) -> None:
    local = build(llama_dir)
    expected = [o.output_token_ids for o in local.generate(
        [{"prompt": p, "params": greedy(10)} for p in PROMPTS])]
    proc = EngineProcess(str(llama_dir), EngineConfig().to_dict())
    try:
        async def go():
            streams = await asyncio.gather(*(_collect(proc, r) for r in _requests(local)))
            gen = proc.generate(local.prepare("long", greedy(400, ignore_eos=True), [], prompt=PROMPTS[0]))
            await gen.__anext__()
            await gen.aclose()  # the client went away after its first token
            for _ in range(100):
                stats = await proc.stats()
                if stats["running"] == 0:
                    break
                await asyncio.sleep(0.05)
            return streams, stats

        streams, stats = asyncio.run(go())
        assert [[ev.token_id for ev in s] for s in streams] == expected
        assert stats["running"] == 0 and stats["kv"]["device"]["in_use"] == 0
        assert stats["threads"] == len(os.sched_getaffinity(0))
    finally:
        proc.close()
    assert proc.proc.returncode == 0 and not proc.healthy()


def test_a_killed_child_fails_its_streams_at_once(llama_dir: Path) -> None:
    local = build(llama_dir)
    proc = EngineProcess(str(llama_dir), EngineConfig().to_dict())
    try:
        async def go():
            gen = proc.generate(local.prepare("doomed", greedy(2000, ignore_eos=True), [], prompt=PROMPTS[0]))
            first = await gen.__anext__()
            os.kill(proc.pid, signal.SIGKILL)
            rest = [ev async for batch in gen for ev in batch]
            return first, rest

        t0 = time.monotonic()
        first, rest = asyncio.run(asyncio.wait_for(go(), 60))
        assert first and rest[-1].finish_reason == "error" and rest[-1].error == ENGINE_GONE
        assert time.monotonic() - t0 < 30
        assert not proc.healthy()
        with pytest.raises(EngineProcessError):
            asyncio.run(_collect(proc, _requests(local)[0]))
    finally:
        proc.close()


_PARENT = """
import json, sys, time
from strata.pipeline.contract.config import EngineConfig
from strata.stages.engine_process import EngineProcess
proc = EngineProcess(sys.argv[1], EngineConfig().to_dict())
print(json.dumps({"child": proc.pid}), flush=True)
time.sleep(600)
"""


def test_the_child_dies_with_its_replica(llama_dir: Path) -> None:
    import subprocess
    import sys
    import tempfile

    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(llama_dir)], stdout=subprocess.PIPE, text=True,
                              cwd=tempfile.gettempdir())
    try:
        child = json.loads(parent.stdout.readline())["child"]
        os.kill(parent.pid, signal.SIGKILL)  # no cleanup runs in the parent
        parent.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child), "the engine process outlived its replica"
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_model_that_will_not_load_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(EngineProcessError) as info:
        EngineProcess(str(tmp_path), EngineConfig().to_dict())
    message = str(info.value)
    assert "\n" not in message and "config" in message.lower(), message

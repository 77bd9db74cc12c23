"""A host tier whose filesystem fills under a real disaggregated server: every request is still
answered with the right tokens; only caching is lost. The model is gpt-oss as released (MXFP4 experts,
sinks, every other layer a sliding window): its windowed cache group crosses the hand-off through the
filling tier, and the decode stage adopts only the prefixes whose windows arrived whole.

The host tier is a small tmpfs of its own (as /dev/shm is, only smaller), so both the block files and
the SQLite index run out of space for real: ENOSPC on a block write and "database or disk is full" on
a commit. The defect this guards against: a failed commit escaped write-through and failed every
request of the step's batch. Mounting needs root (CI runs as root); elsewhere the test is skipped.
"""

from __future__ import annotations

import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from helpers import MODEL_NAME, build, greedy

pytestmark = pytest.mark.slow  # a server of its own on a filesystem of its own

TMPFS_SIZE = "2m"  # a few hundred 12 KB blocks of the tiny model, and the index with them
WORDS = "harbour storm lantern keel gull tide rope sail anchor compass chart mast reef swell".split()


def _prompt(seed: int, n_words: int = 150) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def gpt_oss_dir(text_models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from strata.checkpoints.gpt_oss_mxfp4 import write_gpt_oss_mxfp4

    return write_gpt_oss_mxfp4(text_models["gpt_oss"], tmp_path_factory.mktemp("gpt-oss-mxfp4"))


@pytest.fixture(scope="module")
def full_tier_server(gpt_oss_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from serve_process import ServeProcess

    workdir = tmp_path_factory.mktemp("serve-full-tier")
    host = workdir / "host"
    host.mkdir(mode=0o700)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700", "tmpfs", str(host)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'not root'})")
    config = {"mode": "disaggregated", "reasoning_parser": "none",  # raw text: what the engine returns
              "engine": {"max_model_len": 2048, "host_kv_blocks": 4096, "host_kv_dir": str(host)}}
    proc = ServeProcess(gpt_oss_dir, workdir, config)
    try:
        proc.wait_ready()
        proc.host_dir = host
        yield proc
    finally:
        proc.stop()
        subprocess.run(["umount", "-l", str(host)], capture_output=True)


def _ask(server, prompt: str) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "temperature": 0}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)


def _df_free(path: Path) -> int:
    import os

    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_full_host_tier_costs_caching_never_an_answer(full_tier_server, gpt_oss_dir: Path) -> None:
    prompts = [_prompt(seed) for seed in range(16)]  # ~650 tokens each: far more blocks than 2 MB holds
    engine = build(gpt_oss_dir, max_model_len=2048)
    expected = [engine.generate([{"messages": [{"role": "user", "content": p}], "params": greedy(6)}])[0].text
                for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: _ask(full_tier_server, p), prompts))
    assert [r.status_code for r in answers] == [200] * len(prompts), [r.text for r in answers if r.status_code != 200]
    assert [r.json()["choices"][0]["message"]["content"] for r in answers] == expected
    assert _df_free(full_tier_server.host_dir) < 64 * 1024, "the tier's filesystem really filled"
    stats = httpx.get(full_tier_server.base_url + "/strata/stats", timeout=30).json()
    host = stats["prefill"]["kv"]["tiers"]["host"]
    assert host["write_errors"] > 0, host
    again = _ask(full_tier_server, prompts[0])  # still full: served, and still right
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == expected[0]
    (window,) = stats["decode"]["kv"]["window_slots"]  # the sliding layers' slots, far fewer than the pool's blocks
    assert window["window"] == 12 and window["peak_claimed"] <= window["slots"] < stats["decode"]["kv"]["device"]["total"]

"""Prefix reuse across processes (host tier), across restarts (disk tier) and across block pools."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from helpers import build, build_stages, greedy, run_python
from strata.pipeline.core.sequence import Sequence

pytestmark = pytest.mark.slow  # child processes sharing the tiers


# One engine in a fresh OS process: run one prompt, report tokens and prefix-cache hits.
_ENGINE = textwrap.dedent(
    """
    import json, random, sys
    from strata.pipeline.contract.config import EngineConfig
    from strata.pipeline.contract.sampling_params import SamplingParams
    from strata.stages.factory import build_engine
    model, config = sys.argv[1], json.loads(sys.argv[2])
    rng = random.Random(0)
    ids = [rng.randrange(5, 500) for _ in range(1000)]
    engine = build_engine(model, EngineConfig(**config))
    out = engine.generate([{"prompt_token_ids": ids, "params": SamplingParams(max_tokens=8, temperature=0.0)}])[0]
    stats = engine.kv.stats()
    print(json.dumps({"tokens": out.output_token_ids, "cached": out.num_cached_tokens, "hits": stats["prefix_hit_tokens"]}))
    """
)


def _run_engine(model: Path, **config) -> dict:
    proc = run_python("-c", _ENGINE, str(model), json.dumps(config))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_restart_finds_the_prefix_on_disk(llama_dir: Path, tmp_path: Path) -> None:
    disk = dict(max_model_len=2048, disk_kv_blocks=200, disk_kv_dir=str(tmp_path / "disk"))
    cold = _run_engine(llama_dir, **disk)
    assert cold["cached"] == 0
    restarted = _run_engine(llama_dir, **disk)  # a new process: nothing on its device, the disk remembers
    assert restarted["cached"] == 992 and restarted["hits"]["disk"] == 992
    assert restarted["tokens"] == cold["tokens"]


def test_two_processes_share_a_prefix_through_the_host_tier(llama_dir: Path, tmp_path: Path) -> None:
    host = dict(max_model_len=2048, host_kv_blocks=200, host_kv_dir=str(tmp_path / "host"))
    first = _run_engine(llama_dir, **host)
    second = _run_engine(llama_dir, **host)
    assert first["cached"] == 0 and second["hits"]["host"] == 992
    assert second["tokens"] == first["tokens"]


def test_a_handle_from_another_pool_is_adopted_through_the_host_tier(llama_dir: Path, tmp_path: Path) -> None:
    """Prefill in one engine, decode in another (two block pools, as two Ray replicas would be)."""
    config = dict(max_model_len=2048, host_kv_blocks=200, host_kv_dir=str(tmp_path / "host"))
    prefiller, decoder = build_stages(llama_dir, **config)
    reference = build(llama_dir)
    tokenizer = reference.tokenizer
    request = {"prompt": "Tell me about the tides, the moon and the long way home. " * 4, "params": greedy(10)}
    expected = reference.generate([request])[0].output_token_ids

    enc = tokenizer.encode(tokenizer.render_user_prompt(request["prompt"]), 0)
    assert len(enc.token_ids) > 48
    seq = Sequence("r1", enc.token_ids, greedy(10), 16)
    prefiller.add(seq)
    results = []
    while not results:
        results = prefiller.step()
    (result,) = results
    assert result.kv_handle is not None
    assert prefiller.kv.pool.pool_id != decoder.kv.pool.pool_id
    decoder.admit(result.seq, result.kv_handle)
    tokens = [result.event.token_id]
    while decoder.has_work():
        tokens += [ev.token_id for ev in decoder.step()]
    assert tokens == expected
    hits = decoder.kv.stats()["prefix_hit_tokens"]
    assert hits["host"] == len(enc.token_ids) // 16 * 16  # full blocks came by hash; only the tail was recomputed

"""Tensor- and expert-parallel language stages, in-process (the driver here, rank 1 a child process):
the same greedy tokens and logits as one process, whatever the scheduler does, from each rank's own
slices of the checkpoint; a dead rank fails requests instead of hanging them."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors import safe_open

from helpers import build, greedy, prefill_logits, write_transformers5_checkpoint
from serve_process import listening_sockets
from strata.pipeline.models.model_config import load_model_config
from strata.pipeline.models.model_loader import load_language_model
from strata.pipeline.models.weights import canonical_name, weight_map
from strata.pipeline.parallel.shard_plan import ShardingError, ShardPlan

pytestmark = pytest.mark.slow  # every test forms a group with a child process

PROMPTS = ["Describe the picture.", "Tell me a long story about a lighthouse keeper.", "Count from one to ten.",
           "Why is the sky blue?", "Summarise the image in one sentence.", "List three animals."]


@contextmanager
def engine(model_dir: Path, **config) -> Iterator:
    e = build(model_dir, **config)
    try:
        yield e
    finally:
        e.close()


def _requests(images: list[bytes], max_tokens: int = 12) -> list[dict]:
    return [{"prompt": p, "images": images[: i % 3], "params": greedy(max_tokens + i)} for i, p in enumerate(PROMPTS)]


def _tokens(e, reqs: list[dict]) -> list[list[int]]:
    outs = e.generate(reqs)
    assert all(o.error is None for o in outs)
    return [o.output_token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llava-llama", "llava-mixtral"])
def test_tp2_gives_the_logits_and_greedy_tokens_of_one_process(arch: str, tiny_models, demo_images) -> None:
    model_dir = tiny_models[arch]
    one = build(model_dir)
    before = set(Path("/dev/shm").glob("strata-tp-*"))  # another run, killed mid-rendezvous, may have left one
    with engine(model_dir, tp=2) as two:
        assert two.core.runner.group.transport == "shared memory"
        assert set(Path("/dev/shm").glob("strata-tp-*")) <= before  # channel and store unlinked once the group formed
        ours = [addr for addr, proc in listening_sockets() if "python" in proc]
        loopback = ("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")
        assert ours and all(a.startswith(loopback) for a in ours), ours  # the group listens on lo only
        for images in ([], demo_images[:1]):
            a = prefill_logits(one, "Describe the picture in detail.", images)
            b = prefill_logits(two, "Describe the picture in detail.", images)
            assert ((a - b).abs().max() / a.abs().max()).item() < 1e-4
        reqs = _requests(demo_images)
        assert _tokens(two, reqs) == _tokens(one, reqs)
        assert two.kv.pool.stats()["in_use"] == 0


def test_tp2_matches_across_chunking_prefix_hits_and_preemption(llama_dir: Path, demo_images) -> None:
    small = dict(num_kv_blocks=12, max_num_batched_tokens=64, prefill_chunk_tokens=32)
    reqs = _requests(demo_images, max_tokens=30)
    expected = _tokens(build(llama_dir, **small), reqs)
    with engine(llama_dir, tp=2, **small) as two:
        assert _tokens(two, reqs) == expected
        again = two.generate(reqs[:2])  # the same prompts once more: leading blocks come from the cache
        assert [o.output_token_ids for o in again] == expected[:2]
        assert sum(o.num_cached_tokens for o in again) > 0
        assert two.scheduler.num_preemptions > 0
        two.kv.pool.check_invariants()


@pytest.mark.parametrize("tp", [2, 4], ids=["tp2", "tp4-kv-heads-replicated"])
def test_a_tp_group_spills_to_and_reuses_the_host_tier_with_whole_blocks(tp: int, llama_dir: Path,
                                                                         tmp_path: Path) -> None:
    """A context larger than the device pool: blocks leave for the host tier (gathered from the ranks),
    stream back into attention (each rank takes its heads), and a fresh tp=1 engine reuses the files.
    With tp=4 on the model's 2 KV heads, each KV head lives on two ranks."""
    prompt = "Tell me the whole story of the sea and the stars, from the start. " * 30
    tier = dict(max_model_len=2048, num_kv_blocks=16, prefill_chunk_tokens=64, host_kv_blocks=300)
    expected = _tokens(build(llama_dir, max_model_len=2048), [{"prompt": prompt, "params": greedy(10)}])
    with engine(llama_dir, tp=tp, host_kv_dir=str(tmp_path / "host"), **tier) as group:
        assert _tokens(group, [{"prompt": prompt, "params": greedy(10)}]) == expected
        assert group.kv.spills.peak > 8
    # the tier files hold whole blocks: a one-process engine adopts them as prefix hits
    one = build(llama_dir, host_kv_dir=str(tmp_path / "host"), **tier)
    out = one.generate([{"prompt": prompt, "params": greedy(10)}])[0]
    assert out.output_token_ids == expected[0]
    assert one.kv.stats()["prefix_hit_tokens"]["host"] > 0


@pytest.mark.parametrize("arch", ["llava-llama", "llava-mixtral"])
def test_each_rank_reads_only_its_slices_of_the_shards(arch: str, tiny_models) -> None:
    model_dir = tiny_models[arch]
    whole = load_language_model(model_dir)[1].bytes_read
    replicated = _replicated_bytes(model_dir)  # norms and the router: every rank reads them
    with engine(model_dir, tp=2) as two:
        per_rank = [s.bytes_read for s in two.core.runner.load_stats]
    assert len(per_rank) == 2
    assert sum(per_rank) == whole + replicated
    for b in per_rank:
        assert b <= (whole - replicated) // 2 + replicated + 4 * 1024  # its half (+ uneven vocab rows)


def test_stacked_experts_split_by_expert_too(tiny_models, tmp_path: Path) -> None:
    """The transformers-5 layout stacks a layer's experts in one tensor: each rank reads its rows of it."""
    stacked = tmp_path / "mixtral-t5"
    write_transformers5_checkpoint(tiny_models["llava-mixtral"], stacked)
    one = build(stacked)
    whole = load_language_model(stacked)[1].bytes_read
    with engine(stacked, tp=2) as two:
        a, b = (prefill_logits(e, "Which experts answer this?", []) for e in (one, two))
        assert ((a - b).abs().max() / a.abs().max()).item() < 1e-4
        per_rank = [s.bytes_read for s in two.core.runner.load_stats]
    assert sum(per_rank) == whole + _replicated_bytes(stacked)


def _replicated_bytes(model_dir: Path) -> int:
    total = 0
    for name, shard in weight_map(model_dir).items():
        target = canonical_name(name)
        if target and target[0] == "text" and ("norm" in target[1] or target[1].endswith("mlp.gate.weight")):
            with safe_open(str(model_dir / shard), framework="pt") as f:
                t = f.get_slice(name)
                total += int(torch.tensor(t.get_shape()).prod()) * 4
    return total


def test_the_shard_plan_splits_heads_columns_experts_and_vocab(tiny_models) -> None:
    cfg = load_model_config(tiny_models["llava-mixtral"]).text
    d = cfg.head_dim
    one, two = ShardPlan(cfg, 0, 2), ShardPlan(cfg, 1, 2)
    assert one.slice_for("layers.0.self_attn.q_proj.weight") == (0, 0, cfg.num_heads // 2 * d)
    assert two.slice_for("layers.0.self_attn.k_proj.weight") == (0, cfg.num_kv_heads // 2 * d, cfg.num_kv_heads * d)
    assert two.slice_for("layers.1.self_attn.o_proj.weight") == (1, cfg.num_heads // 2 * d, cfg.num_heads * d)
    assert one.slice_for("layers.0.mlp.experts.gate_up_proj") == (0, 0, cfg.num_experts // 2)
    assert one.slice_for("layers.0.mlp.gate.weight") is None and one.slice_for("norm.weight") is None
    assert two.holds_expert(cfg.num_experts - 1) and not one.holds_expert(cfg.num_experts - 1)
    odd = ShardPlan(replace(cfg, vocab_size=513), 0, 2)
    assert odd.vocab == (0, 256) and odd.padded_vocab == 257
    wide = [ShardPlan(replace(cfg, num_kv_heads=2), r, 4) for r in range(4)]  # more ranks than KV heads
    assert [p.kv_heads for p in wide] == [(0, 1), (0, 1), (1, 2), (1, 2)] and wide[0].kv_replicas == 2


def test_a_model_that_does_not_split_is_refused_before_anything_starts(llama_dir: Path) -> None:
    with pytest.raises(ShardingError, match="tp=3 does not divide the model's 4 attention heads"):
        build(llama_dir, tp=3)
    cfg = load_model_config(llama_dir).text
    with pytest.raises(ShardingError, match="tp=4 neither divides nor is a multiple of the model's 3 KV heads"):
        ShardPlan(replace(cfg, num_kv_heads=3), 0, 4)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        build(llama_dir, tp=0)


def test_a_dead_rank_fails_requests_at_once_and_shutdown_still_returns(llama_dir: Path) -> None:
    e = build(llama_dir, tp=2)
    try:
        assert e.generate([{"prompt": "hi", "params": greedy(4)}])[0].error is None
        stage = e.on_close[0].__self__
        for proc in stage.tp.workers.procs:
            proc.kill()
            proc.wait()
        t0 = time.monotonic()
        out = e.generate([{"prompt": "hi again", "params": greedy(4)}])[0]
        assert out.finish_reason == "error" and "internal error" in out.error
        assert time.monotonic() - t0 < 30
    finally:
        t0 = time.monotonic()
        e.close()
        assert time.monotonic() - t0 < 15

"""Hybrids (Gated DeltaNet, KDA) split over a tensor-parallel group: which heads and which part of the state a rank
holds (``parallel.linear_shards``), and tp=2 against tp=1 through chunks, a prefix hit, preemption and hand-offs
both ways (``core.tp_states``). A tp=2 step abandoned mid-layer is in test_linear_attention.py beside tp=1's."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import build, greedy, tokens_through_handoff
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.core.tp_states import ShardedStatePool
from strata.pipeline.models.model_config import load_model_config
from strata.pipeline.parallel.shard_plan import ShardingError, ShardPlan

PROMPTS = ["What is the capital of France? The quick brown fox jumps over the lazy dog.",
           "Tell me about the tides and the moon. " * 4, "A short one."]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_text", "kimi_linear"])
def any_hybrid(request, text_models) -> Path:
    """Every hybrid's linear layer: Qwen3-Next's fused per-key-head projections, Qwen3.5's projections apart
    (q|k|v cut in three ranges), Kimi-Linear's KDA."""
    return text_models[request.param]


def test_tp2_equals_tp1(any_hybrid: Path, tmp_path: Path, monkeypatch) -> None:
    """Two ranks, each with half the key and value heads and their half of every state: through 5-token
    chunks mixing prefill and decode, a prefix hit (a snapshot copied on every rank), preemption (slots
    zeroed again), and hand-offs both ways (the state gathered from both ranks into tp=1's bytes, and
    scattered from them), every answer is tp=1's and every slot is back."""
    reqs = [{"prompt": p, "params": greedy(10, ignore_eos=True)} for p in PROMPTS]
    one = build(any_hybrid)
    want = [o.output_token_ids for o in one.generate(reqs)]
    two = build(any_hybrid, tp=2, prefill_chunk_tokens=5, max_num_batched_tokens=24, max_num_seqs=4)
    try:
        assert [o.output_token_ids for o in two.generate(reqs)] == want
        again = two.generate(reqs[1:2])[0]
        assert again.output_token_ids == want[1] and again.num_cached_tokens > 0
        assert two.kv.states.pool.stats()["in_use"] == 0
        two.kv.states.check_invariants()
    finally:
        two.close()
    grown = [{"prompt": p, "params": greedy(24, ignore_eos=True)} for p in [*PROMPTS, PROMPTS[1] + " Again."]]
    alone = [o.output_token_ids for o in one.generate(grown)]
    preempting = build(any_hybrid, tp=2, num_kv_blocks=14, max_num_batched_tokens=64, prefill_chunk_tokens=32,
                       enable_prefix_caching=False)
    try:
        assert [o.output_token_ids for o in preempting.generate(grown)] == alone
        assert preempting.scheduler.num_preemptions > 0
    finally:
        preempting.close()
    tp1 = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "host"))
    tp2 = tp1.model_copy(update={"tp": 2})
    installed, install = [], ShardedStatePool.write

    def counted(pool: ShardedStatePool, slot: int, data: bytes) -> None:
        installed.append(slot)
        install(pool, slot, data)

    monkeypatch.setattr(ShardedStatePool, "write", counted)
    for prefill, decode in ((tp2, tp1), (tp1, tp2)):
        assert tokens_through_handoff(any_hybrid, prefill, one, [], PROMPTS[1], greedy(10, ignore_eos=True),
                                      decode_config=decode) == want[1]
    assert len(installed) == 1  # the tp=2 decode took tp=1's state: its blocks adopted, not computed again


def test_a_rank_reads_its_key_heads_and_the_value_heads_they_serve(text_models) -> None:
    """Rank 1 of 2 on Qwen3.5 (2 key heads, 4 value heads, 16 wide): its q, k and v of the fused projection
    and of the convolution are three ranges, read and joined; ``out_proj`` its value heads' input columns."""
    plan = ShardPlan(load_model_config(text_models["qwen3_5_text"]).text, 1, 2)
    three = (0, ((16, 32), (48, 64), (96, 128)))
    assert plan.cut_for("layers.0.linear_attn.in_proj_qkv.weight") == three
    assert plan.cut_for("layers.0.linear_attn.conv1d.weight") == three
    assert plan.cut_for("layers.0.linear_attn.in_proj_z.weight") == (0, ((32, 64),))
    assert plan.cut_for("layers.0.linear_attn.A_log") == (0, ((2, 4),))
    assert plan.cut_for("layers.0.linear_attn.out_proj.weight") == (1, ((32, 64),))
    assert plan.cut_for("layers.0.linear_attn.norm.weight") is None
    assert plan.linear_shards.state_cuts() == {"conv": three, "recurrent": (0, ((2, 4),))}
    with pytest.raises(ShardingError, match="3 ranges"):
        plan.slice_for("layers.0.linear_attn.conv1d.weight")

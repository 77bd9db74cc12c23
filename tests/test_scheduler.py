"""Scheduler policy: token budget, decodes first, chunk cap, preemption by recompute."""

from __future__ import annotations

import torch

from strata.kvstore import BlockPool, KVLayout, TieredKVCache
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.scheduler import Scheduler
from strata.pipeline.core.sequence import Sequence

FP = b"fingerprint"


def _sched(num_blocks: int = 64, **cfg) -> Scheduler:
    # a small step budget comes with as few sequences (each running one must be able to decode per step)
    cfg.setdefault("max_num_seqs", min(64, cfg.get("max_num_batched_tokens", 64)))
    config = EngineConfig(block_size=4, num_kv_blocks=num_blocks, **cfg)
    return Scheduler(config, TieredKVCache(BlockPool(KVLayout.uniform(1, 1, 2, 4, torch.float32), num_blocks), fingerprint=FP))


def _seq(i: int, n: int) -> Sequence:
    return Sequence(f"s{i}", list(range(10 + i, 10 + i + n)), SamplingParams(max_tokens=8, temperature=0), 4)


def _run(s: Scheduler, out) -> None:
    """Pretend the model ran: commit every chunk and append a token where the chunk samples."""
    for c in out.chunks:
        s.commit(c)
        if c.samples:
            c.seq.token_ids.append(1)


def test_budget_chunk_cap_and_decode_priority() -> None:
    s = _sched(max_num_batched_tokens=10, prefill_chunk_tokens=6)
    a, b = _seq(0, 9), _seq(1, 9)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("s0", 6), ("s1", 4)]
    _run(s, out)
    out = s.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("s0", 3), ("s1", 5)]
    _run(s, out)
    s.add(_seq(2, 20))
    out = s.schedule()
    # both decode (1 token each) before the new prompt gets the rest of the budget
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("s0", 1), ("s1", 1), ("s2", 6)]
    assert out.num_tokens <= 10


def test_preempts_newest_when_pool_is_dry_and_requeues_it_first() -> None:
    s = _sched(num_blocks=5, max_num_batched_tokens=32, prefill_chunk_tokens=32)
    a, b = _seq(0, 8), _seq(1, 8)  # 2 blocks each
    s.add(a)
    s.add(b)
    _run(s, s.schedule())
    assert s.kv.pool.num_free() == 1
    for _ in range(4):  # a and b each cross into a new block; only one more block exists
        _run(s, s.schedule())
    assert s.num_preemptions >= 1
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert s.waiting and s.waiting[0] is b and b.num_computed_tokens == 0
    s.kv.pool.check_invariants()

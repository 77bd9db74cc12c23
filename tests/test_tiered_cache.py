"""TieredKVCache through its verbs: reserve, commit, match_prefix, make_handle/adopt, free; spilling,
pins and streaming reads underneath."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata.kvstore import BlockPool, BlockTable, HandleError, KVBlockLostError, KVLayout, LowerTiers, TieredKVCache

LAYOUT = KVLayout.uniform(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)
FP = b"F" * 16


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def cache(tmp_path: Path, device_blocks: int = 8, host_blocks: int = 64, staging: int = 2) -> TieredKVCache:
    lower = LowerTiers.open(LAYOUT, FP, tmp_path / "host", host_blocks)
    return TieredKVCache(BlockPool(LAYOUT, device_blocks), lower, staging, FP)


def fill(c: TieredKVCache, n: int, first: int = 0) -> BlockTable:
    """A table of n full blocks (block i filled with first+i+1), committed and published."""
    table = c.new_table()
    assert c.reserve(table, n * LAYOUT.block_size)
    for i, block_id in enumerate(table.block_ids):
        c.pool.kv.groups[0][block_id] = float(first + i + 1)
    c.commit(table, n * LAYOUT.block_size, [h(first + i) for i in range(n)])
    return table


def test_commit_publishes_full_blocks_and_writes_them_through(tmp_path: Path) -> None:
    c = cache(tmp_path)
    table = c.new_table()
    assert c.reserve(table, 10)  # three blocks for ten tokens
    assert len(table.block_ids) == 3
    c.commit(table, 10, [h(0), h(1)])
    assert table.num_published == 2 and table.num_tokens == 10
    assert all(c.lower.top.contains(h(i)) for i in range(2)) and not c.lower.top.contains(h(2))
    with pytest.raises(ValueError, match="exceed"):
        c.commit(table, 13)


def test_commit_shares_a_block_whose_content_is_already_cached(tmp_path: Path) -> None:
    c = cache(tmp_path)
    a = fill(c, 1)
    b = c.new_table()
    assert c.reserve(b, 4)
    own = b.block_ids[0]
    c.commit(b, 4, [h(0)])  # same hash: b now shares a's block, its own copy is free again
    assert b.block_ids == a.block_ids and c.pool.ref_count(a.block_ids[0]) == 2 and c.pool.ref_count(own) == 0
    c.pool.check_invariants()


def test_reserve_spills_published_blocks_before_refusing(tmp_path: Path) -> None:
    c = cache(tmp_path, device_blocks=8)
    table = fill(c, 6)
    other = c.new_table()
    assert c.reserve(other, 4 * 4)  # 4 blocks: only 2 are free, so 2 of table's are spilled
    assert table.num_spilled == 2 and len(table.block_ids) == 4 and table.first_resident_token == 8
    assert c.stats()["spilled_blocks"] == 2 and c.lower.top.num_pinned() == 2
    assert not c.reserve(other, 20 * 4)  # more than everything: refused, nothing allocated
    assert len(other.block_ids) == 4
    c.pool.check_invariants()


def test_reserve_without_lower_tiers_refuses_when_full() -> None:
    c = TieredKVCache(BlockPool(LAYOUT, 4), fingerprint=FP)
    fill(c, 2)
    table = c.new_table()
    assert c.reserve(table, 8) and not c.reserve(table, 12)
    assert not c.reserve(c.new_table(), 1)


def test_reserve_keeps_the_asked_blocks_free(tmp_path: Path) -> None:
    c = TieredKVCache(BlockPool(LAYOUT, 4), fingerprint=FP)
    table = c.new_table()
    assert not c.reserve(table, 8, keep_free=3)
    assert table.block_ids == [] and c.reserve(table, 8, keep_free=2)


def test_a_shared_prefix_is_not_spilled_for_no_gain(tmp_path: Path) -> None:
    c = cache(tmp_path, device_blocks=6)
    a = fill(c, 4)
    b = c.new_table()
    c.match_prefix(b, [h(0), h(1)], keep_free=0)  # b shares a's first two blocks
    c.reserve(b, 3 * 4)  # and has one block of its own: 5 of 6 in use
    assert c.reserve(c.new_table(), 2 * 4)  # needs one more: a's private blocks go, never the shared ones
    assert a.num_spilled == 3 and b.num_spilled == 0
    assert c.pool.ref_count(b.block_ids[0]) == 1


def test_spilled_blocks_stream_back_and_a_lost_one_is_reported(tmp_path: Path) -> None:
    c = cache(tmp_path)
    table = fill(c, 5)
    assert c.reserve(c.new_table(), 6 * 4)  # spills three of table's blocks
    assert table.num_spilled == 3
    source = c.spilled(table)
    assert source.num_blocks == 3 and source.segment_blocks == 2
    k, v = source.load(1, 0, 2)
    assert k.shape == (2, 4, 1, 4)
    assert torch.equal(k[0], torch.full((4, 1, 4), 1.0)) and torch.equal(v[1], torch.full((4, 1, 4), 2.0))
    with pytest.raises(ValueError, match="staging"):
        c.load_spilled(table.hashes[:3], layer=0)
    c.lower.top.remove(h(2))
    if c.pool.lookup(h(2)) is not None:  # make sure the device cannot serve it either
        c.pool.allocate(), c.pool.allocate()
    with pytest.raises(KVBlockLostError):
        source.load(0, 2, 1)


def test_prefix_match_references_promotes_and_leaves_the_oldest_spilled(tmp_path: Path) -> None:
    c = cache(tmp_path, device_blocks=8)
    c.free(fill(c, 6))
    fresh = TieredKVCache(BlockPool(LAYOUT, 8), c.lower, 2, FP)  # a new device pool over the same host tier
    table = fresh.new_table()
    match = fresh.match_prefix(table, [h(i) for i in range(7)], keep_free=4)  # block 6 was never computed
    assert (match.num_blocks, match.num_spilled, match.by_tier) == (6, 2, {"host": 6})
    assert match.num_tokens == 6 * LAYOUT.block_size
    assert table.num_spilled == 2 and len(table.block_ids) == 4  # 8 free - 4 kept free = 4 promoted
    assert table.num_tokens == 24 and table.hashes == [h(i) for i in range(6)]
    assert fresh.pool.kv.groups[0][table.block_ids[0]].eq(3.0).all()
    assert fresh.stats()["prefix_hit_tokens"]["host"] == 6 * 4
    with pytest.raises(ValueError, match="empty"):
        fresh.match_prefix(table, [h(0)], keep_free=0)


def test_pins_are_counted_per_table(tmp_path: Path) -> None:
    c = cache(tmp_path, device_blocks=8)
    c.free(fill(c, 4))
    hashes = [h(i) for i in range(4)]
    a, b = c.new_table(), c.new_table()
    c.match_prefix(a, hashes, keep_free=8)  # nothing fits on the device: all four stay spilled
    c.match_prefix(b, hashes, keep_free=8)
    assert a.num_spilled == b.num_spilled == 4 and c.lower.top.num_pinned() == 4
    c.free(a)
    assert c.lower.top.num_pinned() == 4  # b still reads them
    c.free(b)
    assert c.lower.top.num_pinned() == 0 and c.spills.current == 0
    c.free(b)  # idempotent
    assert c.lower.top.num_pinned() == 0


def test_a_handle_moves_a_table_to_another_owner_on_the_same_pool(tmp_path: Path) -> None:
    c = cache(tmp_path)
    table = fill(c, 2)
    assert c.reserve(table, 10)
    c.commit(table, 10, [h(0), h(1)])  # two full blocks and a tail of two tokens
    in_use = c.pool.stats()["in_use"]
    handle = c.make_handle(table)
    assert (handle.num_tokens, len(handle.block_ids), handle.tail_block is not None) == (10, 2, True)
    adopted = c.adopt(handle)
    assert adopted.block_ids == table.block_ids and adopted.hashes == [h(0), h(1)] and adopted.num_tokens == 10
    assert c.pool.stats()["in_use"] == in_use  # references moved, not copied
    c.free(adopted)
    assert c.pool.stats()["in_use"] == 0


def test_a_released_handle_is_adopted_by_hash_on_another_pool(tmp_path: Path) -> None:
    c = cache(tmp_path)
    handle = c.make_handle(fill(c, 3), release=True)
    assert c.pool.stats()["in_use"] == 0 and c.pool.stats()["cached"] == 3
    other = TieredKVCache(BlockPool(LAYOUT, 8), c.lower, 2, FP)
    assert other.adopt(handle) is None  # another pool: adopt by prefix match instead
    assert other.match_prefix(other.new_table(), handle.block_hashes, keep_free=0).num_blocks == 3
    with pytest.raises(HandleError, match="another model"):
        TieredKVCache(BlockPool(LAYOUT, 8), c.lower, 2, b"G" * 16).adopt(handle)


def test_block_arithmetic_is_the_kv_stores(tmp_path: Path) -> None:
    """The verbs the scheduler, intake and model runner use instead of computing blocks themselves."""
    from strata.kvstore import blocks_for_tokens, chunk_working_set_blocks

    c = cache(tmp_path)
    bs = LAYOUT.block_size
    # the block holding a prompt's last token is never matched: that token's logits are sampled
    assert [c.matchable_blocks(n) for n in (1, bs, bs + 1, 2 * bs, 2 * bs + 1)] == [0, 0, 1, 1, 2]
    assert [blocks_for_tokens(n, bs) for n in (1, bs, bs + 1)] == [1, 1, 2]
    assert c.chunk_working_set(2 * bs) == chunk_working_set_blocks(2 * bs, bs) == 3  # may straddle one more
    table = fill(c, 3)
    for position in range(3 * bs):
        assert table.slot(position) == table.slots(position, position + 1)[0]

"""TieredKVCache on block tables: write-through, prefix match across tiers, spill, pins, streaming."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore import BlockPool, BlockTable, KVBlockLostError, KVLayout, LowerTiers, TieredKVCache

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)
FP = b"F" * 16


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def cache(tmp_path: Path, device_blocks: int = 8, host_blocks: int = 64, staging: int = 2) -> TieredKVCache:
    lower = LowerTiers.open(LAYOUT, FP, tmp_path / "host", host_blocks)
    return TieredKVCache(BlockPool(LAYOUT, device_blocks), lower, staging)


def fill(c: TieredKVCache, n: int) -> BlockTable:
    """A table of n full blocks with distinct contents (block i is filled with i+1), published."""
    table = BlockTable(LAYOUT.block_size)
    for i in range(n):
        block_id = c.pool.allocate()
        c.pool.kv[block_id] = float(i + 1)
        table.block_ids.append(block_id)
    table.num_tokens = n * LAYOUT.block_size
    c.publish(table, [h(i) for i in range(n)], 0, n)
    return table


def test_publish_writes_full_blocks_through_to_the_host_tier(tmp_path: Path) -> None:
    c = cache(tmp_path)
    fill(c, 3)
    assert all(c.lower.top.contains(h(i)) for i in range(3))


def test_spill_frees_device_blocks_and_attention_streams_them_back(tmp_path: Path) -> None:
    c = cache(tmp_path)
    table = fill(c, 5)
    hashes = [h(i) for i in range(5)]
    assert c.spill(table, hashes, 3) == 3
    assert table.num_spilled == 3 and len(table.block_ids) == 2 and table.first_resident_token == 12
    assert c.pool.num_free() == 8 - 2  # the spilled blocks are allocatable again
    for b in range(3):  # force the file path: drop the device copies
        c.pool.allocate()
    k, v = c.load_spilled(hashes[:2], layer=1)
    assert k.shape == (2, 4, 1, 4)
    assert torch.equal(k[0], torch.full((4, 1, 4), 1.0)) and torch.equal(v[1], torch.full((4, 1, 4), 2.0))
    with pytest.raises(ValueError, match="staging"):
        c.load_spilled(hashes[:3], layer=0)


def test_a_spilled_block_that_vanished_is_reported_not_invented(tmp_path: Path) -> None:
    c = cache(tmp_path)
    table = fill(c, 3)
    c.spill(table, [h(i) for i in range(3)], 1)
    c.pool.allocate(), c.pool.allocate(), c.pool.allocate(), c.pool.allocate(), c.pool.allocate(), c.pool.allocate()
    c.lower.top.remove(h(0))
    with pytest.raises(KVBlockLostError):
        c.load_spilled([h(0)], layer=0)


def test_prefix_match_references_promotes_and_leaves_the_oldest_spilled(tmp_path: Path) -> None:
    c = cache(tmp_path, device_blocks=8)
    first = fill(c, 6)
    c.release(first, [h(i) for i in range(6)])
    fresh = TieredKVCache(BlockPool(LAYOUT, 8), c.lower, 2)  # a new device pool over the same host tier
    table = BlockTable(LAYOUT.block_size)
    matched = fresh.match_prefix(table, [h(i) for i in range(7)], reserve=4)  # block 6 was never computed
    assert matched == 6
    assert table.num_spilled == 2 and len(table.block_ids) == 4  # 8 free - 4 reserved = 4 promoted
    assert torch.equal(fresh.pool.kv[table.block_ids[0]], torch.full(LAYOUT.block_shape(), 3.0))
    assert fresh.stats()["prefix_hit_tokens"]["host"] == 6 * 4


def test_pins_are_counted_per_sequence(tmp_path: Path) -> None:
    c = cache(tmp_path, device_blocks=8)
    c.release(fill(c, 4), [h(i) for i in range(4)])
    hashes = [h(i) for i in range(4)]
    a, b = BlockTable(4), BlockTable(4)
    c.match_prefix(a, hashes, reserve=8)  # nothing fits on the device: all four stay spilled
    c.match_prefix(b, hashes, reserve=8)
    assert a.num_spilled == b.num_spilled == 4 and c.lower.top.num_pinned() == 4
    c.release(a, hashes)
    assert c.lower.top.num_pinned() == 4  # b still reads them
    c.release(b, hashes)
    assert c.lower.top.num_pinned() == 0 and c.spilled_blocks == 0


def test_without_lower_tiers_nothing_spills(tmp_path: Path) -> None:
    c = TieredKVCache(BlockPool(LAYOUT, 4))
    table = fill(c, 2)
    assert not c.can_spill and c.spillable(table, 2) == 0


def test_spill_plan_counts_only_blocks_that_would_be_freed(tmp_path: Path) -> None:
    c = cache(tmp_path, device_blocks=8)
    table = fill(c, 4)
    for block_id in table.block_ids[:2]:  # another sequence shares the first two blocks
        c.pool.incref(block_id)
    assert c.spill_plan(table, 4, want=1) == (3, 1)  # the shared pair frees nothing; the third frees one
    assert c.spill_plan(table, 4, want=5) == (4, 2)  # everything spillable frees two at most
    assert c.spill_plan(table, 2, want=1) == (2, 0)  # only the shared, published ones: no gain

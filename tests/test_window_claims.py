"""The KV store's verbs on a layout with a sliding-window group: a table claims only its window's slots,
gives them up as it grows, hands a duplicate's claim to the cached copy, never spills or adopts as
spilled a block a window still reads, and never writes a block below whose windowed part is gone."""

from __future__ import annotations

from pathlib import Path

import torch

from strata.kvstore import BlockPool, CacheGroup, KVLayout, LowerTiers, TieredKVCache

BS, WINDOW = 4, 6  # a query at position n reads keys n-5..n: at most three blocks of the windowed group
LAYOUT = KVLayout((CacheGroup((1,), 1, 4), CacheGroup((0, 2), 1, 4, window=WINDOW)), BS)
FP = b"W" * 16


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def cache(tmp_path: Path | None, device_blocks: int = 16, slots: int = 6, host_blocks: int = 64) -> TieredKVCache:
    lower = LowerTiers.open(LAYOUT, FP, tmp_path / "host", host_blocks) if tmp_path is not None else None
    return TieredKVCache(BlockPool(LAYOUT, device_blocks, window_slots={1: slots}), lower, 2, FP)


def grow(c: TieredKVCache, table, num_tokens: int, first_hash: int = 0) -> None:
    """Reserve and commit up to ``num_tokens``, one block at a time, publishing every full block; each
    block's values are its hash index + 1 in both groups."""
    while table.num_tokens < num_tokens:
        end = min(num_tokens, (table.num_tokens // BS + 1) * BS)
        assert c.reserve(table, end)
        j = end // BS - (end % BS == 0) - table.num_spilled
        block = table.block_ids[j]
        c.pool.kv.layers[1][block] = float(first_hash + j + table.num_spilled + 1)
        c.pool.kv.layers[0][c.pool.windows[1].slot[block]] = float(first_hash + j + table.num_spilled + 1)
        c.commit(table, end, [h(first_hash + i) for i in range(end // BS)])


def test_a_growing_table_holds_only_its_window_in_the_windowed_group() -> None:
    c = cache(None)
    table = c.new_table()
    grow(c, table, 40)  # ten blocks
    window = c.pool.windows[1]
    assert table.window_starts[1] == (40 - WINDOW + 1) // BS == 8
    assert [window.claims[b] for b in table.block_ids] == [0] * 8 + [1] * 2
    assert window.num_claimed() == 2 and window.peak_claimed <= 3
    c.pool.check_invariants()
    c.free(table)
    assert window.num_claimed() == 0 and window.stats()["idle"] > 0  # published parts stay for a prefix hit
    c.pool.check_invariants()


def test_reserve_refuses_when_the_windowed_slots_are_all_claimed_and_allocates_nothing() -> None:
    c = cache(None, slots=3)
    a, b = c.new_table(), c.new_table()
    assert c.reserve(a, 3 * BS)  # three fresh blocks: every slot claimed
    before = c.pool.stats()
    assert not c.reserve(b, BS)
    assert c.pool.stats() == before and b.is_empty()
    c.commit(a, 3 * BS, [h(0), h(1), h(2)])  # the window moves past block 0: its slot goes idle
    assert c.reserve(b, BS)
    c.pool.check_invariants()


def test_a_duplicate_block_hands_its_claim_to_the_cached_copy() -> None:
    c = cache(None)
    a, b = c.new_table(), c.new_table()
    grow(c, a, BS)
    assert c.reserve(b, BS)
    own = b.block_ids[0]
    c.commit(b, BS, [h(0)])  # same content as a's block: b shares it, its own block and slot are freed
    shared = a.block_ids[0]
    assert b.block_ids == [shared] and c.pool.windows[1].claims[shared] == 2 and not c.pool.windows[1].has(own)
    c.pool.check_invariants()


def test_spilling_never_moves_a_block_a_window_still_reads(tmp_path: Path) -> None:
    c = cache(tmp_path, device_blocks=6)
    table = c.new_table()
    grow(c, table, 40)  # ten blocks through a six-block device: the oldest spill
    assert table.num_spilled > 0 and table.num_spilled <= table.window_floor()
    assert all(c.pool.windows[1].has(b) for b in table.block_ids[table.window_starts[1] - table.num_spilled :])
    c.pool.check_invariants()


def test_a_prefix_from_the_tiers_adopts_its_window_onto_the_device(tmp_path: Path) -> None:
    c = cache(tmp_path, device_blocks=16)
    grow(c, c.new_table(), 40)
    fresh = cache(tmp_path, device_blocks=6)  # another pool over the same tier: only six blocks of room
    table = fresh.new_table()
    match = fresh.match_prefix(table, [h(i) for i in range(10)], keep_free=1)
    assert match.num_blocks == 10 and match.num_spilled <= (40 - WINDOW + 1) // BS
    start = table.window_starts[1]
    for j in range(start, 10):  # the window's parts came back whole, claimed, with the right values
        block = table.block_ids[j - table.num_spilled]
        slot = fresh.pool.windows[1].slot[block]
        assert fresh.pool.windows[1].claims[block] == 1 and fresh.pool.kv.layers[0][slot].eq(j + 1).all()
    fresh.pool.check_invariants()


def test_a_block_whose_windowed_part_is_gone_is_never_written_below(tmp_path: Path) -> None:
    c = cache(tmp_path, slots=6)
    table = c.new_table()
    grow(c, table, 4 * BS)  # window starts at block 2: blocks 0 and 1 keep idle parts
    first = table.block_ids[0]
    assert c.lower.top.contains(h(0))  # written through while its windowed part was there
    c.lower.top.remove(h(0))
    other = c.new_table()
    assert c.reserve(other, 4 * BS)  # two free slots and the two idle ones, oldest (block 0's) first
    assert c.pool.windows[1].num_reclaimed == 2 and not c.pool.complete(first)
    assert not c.copies.ensure_below(h(0)) and not c.lower.top.contains(h(0))  # no block with a hole below
    torch.testing.assert_close(c.pool.kv.layers[1][first], torch.full_like(c.pool.kv.layers[1][first], 1.0))
    c.pool.check_invariants()

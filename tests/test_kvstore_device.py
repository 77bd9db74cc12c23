"""Device tier of the KV store: layout, hash chain, block pool, block table."""

from __future__ import annotations

import random
from collections import Counter

import msgpack
import pytest
import torch

from strata.kvstore import (
    BlockPool,
    BlockTable,
    CacheGroup,
    DeviceBlocks,
    ImageSpan,
    KVLayout,
    NoFreeBlocksError,
    TieredKVCache,
    block_extras,
    hash_block,
    hash_chain,
    model_fingerprint,
)

BS = 4
FP = model_fingerprint("llava", "sha256:abc", "float32", BS)
SMALL = KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=4, block_size=BS)


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


# ---------------------------------------------------------------- layout
def test_layout_llama3_8b_bytes_per_token() -> None:
    lay = KVLayout.uniform(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    assert lay.bytes_per_token() == 131072
    assert lay.bytes_per_block() == 131072 * 16
    assert lay.groups[0].layer_shape(lay.block_size) == (2, 16, 8, 128) and lay.slot_offsets[1] == 2 * 16 * 8 * 128 * 2


def test_layout_roundtrip_msgpack() -> None:
    lay = KVLayout.uniform(4, 2, 64, block_size=32, dtype=torch.float16)
    d = msgpack.unpackb(msgpack.packb(lay.to_dict()))
    assert d["groups"][0]["dtype"] == "float16"
    assert KVLayout.from_dict(d) == lay
    mixed = KVLayout((CacheGroup((1, 3), 2, 8), CacheGroup((0, 2), 2, 8, window=128)), 4)
    assert KVLayout.from_dict(msgpack.unpackb(msgpack.packb(mixed.to_dict()))) == mixed


def test_cache_groups_cover_every_layer_once_and_place_each_in_the_block_bytes() -> None:
    """A block's bytes are its groups in order: a layer's slot follows its group, not its index."""
    full = CacheGroup((1, 3), num_kv_heads=2, head_dim=8)
    latent = CacheGroup((0, 2), num_kv_heads=1, head_dim=12, kv_parts=1, dtype=torch.bfloat16)
    lay = KVLayout((full, latent), block_size=4)
    per_full, per_latent = 2 * 4 * 2 * 8 * 4, 1 * 4 * 1 * 12 * 2
    assert [lay.slot_of(i) for i in range(4)] == [2, 0, 3, 1]
    assert lay.group_of(2) == (1, 1)
    assert lay.slot_offsets == (0, per_full, 2 * per_full, 2 * per_full + per_latent, 2 * (per_full + per_latent))
    assert lay.bytes_per_token() * 4 == lay.bytes_per_block()
    with pytest.raises(ValueError, match="differ in dtype"):
        lay.dtype
    assert lay.per_rank(2).groups == (full.with_heads(1), latent)  # one latent head stays whole on each rank
    with pytest.raises(ValueError, match="cover layers"):
        KVLayout((full,), 4)  # layers 0 and 2 belong to no group
    with pytest.raises(ValueError, match="cover layers"):
        KVLayout((full, CacheGroup((0, 1, 2), 2, 8)), 4)  # layer 1 in two groups
    with pytest.raises(ValueError, match="window"):
        CacheGroup((0,), 2, 8, window=0)


def test_a_pool_holds_a_tensor_per_group_and_a_block_crosses_as_its_bytes() -> None:
    """A windowed group keeps its part of a block in a slot of its own, smaller tensor; a block's bytes
    gather every group's part, and a block whose windowed part is gone has no bytes to give."""
    lay = KVLayout((CacheGroup((1,), 2, 4), CacheGroup((0, 2), 1, 6, window=8)), block_size=BS)
    pool = BlockPool(lay, 3, window_slots={1: 2})
    assert [tuple(t.shape) for t in pool.kv.groups] == [(3, 1, 2, BS, 2, 4), (2, 2, 2, BS, 1, 6)]
    assert pool.kv.layers[2].data_ptr() == pool.kv.groups[1][:, 1].data_ptr()  # layer 2: group 1's second layer
    window = pool.windows[1]
    a, b = pool.allocate(), pool.allocate()
    window.claim_new(a)
    window.claim_new(b)
    assert pool.storage_ids(a) == [a, window.slot[a]] and pool.complete(a)
    pool.kv.layers[0][window.slot[a]].fill_(5.0)
    pool.kv.layers[1][a].fill_(7.0)
    blocks = DeviceBlocks(pool)
    data = blocks.read(a)
    assert data.dtype == torch.uint8 and data.numel() == lay.bytes_per_block()
    blocks.write(b, data)
    assert pool.kv.layers[0][window.slot[b]].eq(5.0).all() and pool.kv.layers[1][b].eq(7.0).all()
    window.release(b, keep=False)  # the window moved past b (unpublished): its part is gone
    assert not pool.complete(b) and pool.storage_ids(b)[1] == -1
    with pytest.raises(ValueError, match="not on the device"):
        blocks.read(b)
    blocks.write(b, data)  # a write skips the part with no slot
    window.release(a, keep=False)
    pool.free(a)
    pool.free(b)
    pool.check_invariants()
    assert pool.kv.nbytes() == 3 * lay.slot_offsets[1] + 2 * (lay.bytes_per_block() - lay.slot_offsets[1])


# ---------------------------------------------------------------- hashing
def test_fingerprint_depends_on_every_field() -> None:
    base = ("llava", "w", "float32", 16)
    fps = {model_fingerprint(*base)}
    for i, alt in enumerate(("llava2", "w2", "bfloat16", 32)):
        args = list(base)
        args[i] = alt
        fps.add(model_fingerprint(*args))
    assert len(fps) == 5
    assert model_fingerprint(*base) == model_fingerprint(*base)


def test_hash_block_unambiguous() -> None:
    assert hash_block(FP, [1, 2], [b"ab"]) != hash_block(FP, [1, 2], [b"a", b"b"])
    assert hash_block(FP, [1, 2]) != hash_block(FP, [1, 2], [b""])
    assert hash_block(FP, [1]) != hash_block(FP, [256])
    assert len(hash_block(FP, [1, 2, 3])) == 16


def test_chain_deterministic_and_fingerprinted() -> None:
    toks = list(range(10))
    a = hash_chain(FP, toks, BS)
    assert a == hash_chain(FP, toks, BS)
    assert len(a) == 2  # 10 tokens -> 2 full blocks, tail gets no hash
    assert all(isinstance(x, bytes) and len(x) == 16 for x in a)
    other = model_fingerprint("llava", "sha256:other", "float32", BS)
    b = hash_chain(other, toks, BS)
    assert not set(a) & set(b)


def test_chain_partial_tail_and_prefix_sharing() -> None:
    toks = list(range(12))
    assert hash_chain(FP, toks[:11], BS) == hash_chain(FP, toks[:8], BS)
    assert hash_chain(FP, toks[:3], BS) == []
    diverged = toks[:5] + [99] + toks[6:]
    x, y = hash_chain(FP, toks, BS), hash_chain(FP, diverged, BS)
    assert x[0] == y[0] and x[1] != y[1] and x[2] != y[2]


def test_image_content_changes_overlapping_and_later_blocks_only() -> None:
    toks = [7] * 24  # 6 blocks of 4; placeholder tokens are identical
    span_a = ImageSpan(offset=6, length=5, content_hash=b"A" * 16)  # blocks 1, 2
    span_b = ImageSpan(offset=6, length=5, content_hash=b"B" * 16)
    plain = hash_chain(FP, toks, BS)
    a = hash_chain(FP, toks, BS, [span_a])
    b = hash_chain(FP, toks, BS, [span_b])
    assert a[0] == b[0] == plain[0]  # before the image: untouched
    for i in range(1, 6):  # overlapping blocks and every later one (chain)
        assert a[i] != b[i]
    assert len(block_extras(4, 8, [span_a])) == 1
    assert block_extras(0, 4, [span_a]) == ()
    assert block_extras(11, 12, [span_a]) == ()  # span end is exclusive
    assert len(block_extras(10, 11, [span_a])) == 1


def test_image_geometry_is_part_of_the_key() -> None:
    toks = [7] * 8
    c1, c2 = b"1" * 16, b"2" * 16
    split_a = [ImageSpan(0, 2, c1), ImageSpan(2, 2, c2)]
    split_b = [ImageSpan(0, 1, c1), ImageSpan(1, 3, c2)]
    assert hash_chain(FP, toks, BS, split_a)[0] != hash_chain(FP, toks, BS, split_b)[0]


def test_start_hashes_incremental_equals_full() -> None:
    rng = random.Random(0)
    toks = [rng.randrange(32000) for _ in range(50)]
    spans = [ImageSpan(9, 14, b"x" * 16), ImageSpan(30, 3, b"y" * 16)]
    full = hash_chain(FP, toks, BS, spans)
    for cut in range(0, 51, 3):
        known = hash_chain(FP, toks[:cut], BS, spans)
        assert hash_chain(FP, toks, BS, spans, start_hashes=known) == full
    with pytest.raises(ValueError):
        hash_chain(FP, toks[:4], BS, start_hashes=full)


# ---------------------------------------------------------------- pool
def test_kv_tensor_and_views() -> None:
    pool = BlockPool(SMALL, 5)
    assert len(pool.kv.groups) == 1 and pool.kv.groups[0].shape == (5, 2, 2, BS, 2, 4)
    assert pool.k_cache(1).shape == (5, BS, 2, 4)
    pool.k_cache(1)[3].fill_(2.0)
    assert pool.kv.groups[0][3, 1, 0].eq(2.0).all() and pool.kv.groups[0][3, 1, 1].eq(0).all()


def test_allocate_until_exhausted_then_free() -> None:
    pool = BlockPool(SMALL, 4)
    ids = [pool.allocate() for _ in range(4)]
    assert sorted(ids) == [0, 1, 2, 3]
    assert pool.num_free() == 0 and not pool.can_allocate(1)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    assert issubclass(NoFreeBlocksError, RuntimeError)
    pool.free(ids[2])
    assert pool.num_free() == 1 and pool.can_allocate(1) and not pool.can_allocate(2)
    assert pool.allocate() == ids[2]
    with pytest.raises(ValueError):
        BlockPool(SMALL, 4).free(0)  # double free / never allocated


def test_published_block_reused_with_contents() -> None:
    pool = BlockPool(SMALL, 4)
    hashes = hash_chain(FP, list(range(8)), BS)
    blocks = [pool.allocate() for _ in hashes]
    for i, (b, hh) in enumerate(zip(blocks, hashes)):
        pool.kv.groups[0][b].fill_(float(i + 1))
        assert pool.publish(b, hh) == b
        assert pool.block_hash(b) == hh
    for b in blocks:
        pool.free(b)
    assert pool.stats()["cached"] == 2 and pool.num_free() == 4
    # a fresh allocation prefers truly free blocks over cached ones
    tmp = pool.allocate()
    assert tmp not in blocks
    pool.free(tmp)
    kv = TieredKVCache(pool, fingerprint=FP)
    table = kv.new_table()
    match = kv.match_prefix(table, hashes + [h(12345)], keep_free=0)
    got = table.block_ids
    assert got == blocks and match.num_blocks == 2 and match.by_tier == {"device": 2}
    assert [pool.ref_count(b) for b in got] == [1, 1]
    for i, b in enumerate(got):
        assert pool.kv.groups[0][b].eq(float(i + 1)).all()
    s = kv.stats()
    assert s["prefix_queried_tokens"] == 3 * BS and s["prefix_hit_tokens"] == {"device": 2 * BS}
    assert s["device"]["cached"] == 0 and s["device"]["in_use"] == 2


def test_match_prefix_stops_at_first_miss() -> None:
    pool = BlockPool(SMALL, 4)
    a, c = pool.allocate(), pool.allocate()
    pool.publish(a, h(1))
    pool.publish(c, h(3))
    kv = TieredKVCache(pool, fingerprint=FP)
    first, second = kv.new_table(), kv.new_table()
    assert kv.match_prefix(first, [h(1), h(2), h(3)], keep_free=0).num_blocks == 1 and first.block_ids == [a]
    assert pool.ref_count(a) == 2 and pool.ref_count(c) == 1
    assert kv.match_prefix(second, [h(2), h(1)], keep_free=0).num_blocks == 0 and second.block_ids == []
    assert pool.lookup(h(3)) == c and pool.ref_count(c) == 1  # lookup: no ref change


def test_lru_evicts_least_recently_released_first() -> None:
    pool = BlockPool(SMALL, 3)
    b = [pool.allocate() for _ in range(3)]
    for i in range(3):
        pool.publish(b[i], h(i))
    for i in (1, 0, 2):  # release order defines LRU
        pool.free(b[i])
    # touching b[1] via a prefix match then releasing makes it most recent
    kv = TieredKVCache(pool, fingerprint=FP)
    table = kv.new_table()
    kv.match_prefix(table, [h(1)], keep_free=0)
    assert table.block_ids == [b[1]]
    kv.free(table)
    evicted_order = []
    for _ in range(3):
        before = {i for i in range(3) if pool.lookup(h(i)) is not None}
        pool.allocate()
        after = {i for i in range(3) if pool.lookup(h(i)) is not None}
        evicted_order.extend(before - after)
    assert evicted_order == [0, 2, 1]
    assert pool.stats()["evictions"] == 3
    assert all(pool.block_hash(x) is None for x in b)


def test_referenced_blocks_never_evicted() -> None:
    pool = BlockPool(SMALL, 3)
    b = [pool.allocate() for _ in range(3)]
    for i in range(3):
        pool.publish(b[i], h(i))
    pool.free(b[0])
    assert pool.num_free() == 1
    assert pool.allocate() == b[0]  # only the unreferenced one may go
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    assert pool.lookup(h(1)) == b[1] and pool.lookup(h(2)) == b[2]


def test_publish_dedupe_returns_existing() -> None:
    pool = BlockPool(SMALL, 4)
    first, dup = pool.allocate(), pool.allocate()
    assert pool.publish(first, h(7)) == first
    assert pool.publish(dup, h(7)) == first
    assert pool.block_hash(dup) is None and pool.lookup(h(7)) == first
    assert pool.ref_count(first) == 1 and pool.ref_count(dup) == 1
    pool.free(dup)  # unhashed -> truly free
    assert pool.stats()["free"] == 3
    assert pool.publish(first, h(7)) == first  # idempotent
    with pytest.raises(ValueError):
        pool.publish(first, h(8))
    # dedupe against a cached ref-0 block also works
    pool.free(first)
    other = pool.allocate()
    assert pool.publish(other, h(7)) == first


def test_randomized_invariants() -> None:
    rng = random.Random(1234)
    n = 12
    pool = BlockPool(SMALL, n)
    held: list[int] = []  # multiset of references we own
    model_hash: dict[int, bytes] = {}
    for _ in range(3000):
        op = rng.random()
        if len(held) > n:  # keep the pool oscillating around full, not pinned there
            op = 0.4
        refs = Counter(held)
        if op < 0.3:
            truly_free = sum(1 for b in range(n) if refs[b] == 0 and b not in model_hash)
            ev_before = pool.stats()["evictions"]
            if pool.num_free() == 0:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate()
            else:
                b = pool.allocate()
                assert refs[b] == 0, "allocated a referenced block"
                assert (pool.stats()["evictions"] > ev_before) == (truly_free == 0)
                model_hash.pop(b, None)
                held.append(b)
        elif op < 0.55 and held:
            pool.free(held.pop(rng.randrange(len(held))))
        elif op < 0.65 and held:
            b = rng.choice(held)
            pool.incref(b)
            held.append(b)
        elif op < 0.8 and held:
            b = rng.choice(held)
            hh = h(rng.randrange(20))
            canon = pool.publish(b, hh) if model_hash.get(b, hh) == hh else None
            if canon == b:
                model_hash[b] = hh
            elif canon is not None:
                assert model_hash.get(canon) == hh and b not in model_hash
        else:
            query = [h(rng.randrange(20)) for _ in range(rng.randrange(1, 5))]
            got = []  # a device prefix match: look up each leading hash and reference its block
            for hh in query:
                b = pool.lookup(hh)
                if b is None:
                    break
                pool.incref(b)
                got.append(b)
            for b, hh in zip(got, query):
                assert model_hash[b] == hh
            if len(got) < len(query):
                assert pool.lookup(query[len(got)]) is None
            held.extend(got)
        # ---- invariants after every op
        pool.check_invariants()
        refs = Counter(held)
        for b in range(n):
            assert pool.ref_count(b) == refs[b]
            assert pool.block_hash(b) == model_hash.get(b)
        idle = sum(1 for b in range(n) if refs[b] == 0)
        assert pool.num_free() == idle
        s = pool.stats()
        assert s["free"] + s["cached"] + s["in_use"] == n
        assert s["in_use"] == len(refs)
        assert s["cached"] == sum(1 for b in model_hash if refs[b] == 0)


# ---------------------------------------------------------------- block table
def test_block_table() -> None:
    t = BlockTable(block_size=4)
    assert t.blocks_needed(0) == 0 and t.blocks_needed(1) == 1 and t.blocks_needed(9) == 3
    t.block_ids = [5, 2]
    t.num_tokens = 6
    assert t.num_full_blocks() == 1 and t.capacity() == 8
    assert t.blocks_needed(8) == 0 and t.blocks_needed(9) == 1
    assert t.slots(2, 7) == [22, 23, 8, 9, 10]
    assert t.slots(3, 3) == []
    with pytest.raises(IndexError):
        t.slots(6, 9)
    t.num_tokens = 8
    assert t.num_full_blocks() == 2

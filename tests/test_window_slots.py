"""The slot state machine of a sliding-window cache group (``kvstore.window_slots``), driven through
every transition with its invariants checked after each."""

from __future__ import annotations

import random

import pytest

from strata.kvstore.window_slots import NoFreeSlotsError, WindowSlots


def test_a_released_published_part_stays_idle_until_a_new_claim_needs_its_slot() -> None:
    w = WindowSlots(num_slots=2, num_blocks=5, window=8)
    w.claim_new(0)
    w.claim_new(1)
    with pytest.raises(NoFreeSlotsError):
        w.claim_new(2)  # both slots claimed
    w.release(0, keep=True)  # published: kept for a prefix hit
    assert w.has(0) and w.num_available() == 1
    assert w.claim(0) and w.claims[0] == 1  # a prefix hit takes it back, content intact
    w.release(0, keep=True)
    w.claim_new(2)  # reclaims block 0's idle slot
    assert not w.has(0) and w.num_reclaimed == 1
    assert not w.claim(0)  # its part is gone: a prefix hit must not read it
    w.release(1, keep=False)  # unpublished: no one can ask for it again, the slot frees at once
    assert not w.has(1) and w.num_available() == 1
    w.check_invariants()


def test_a_block_leaving_the_device_takes_its_part_and_never_while_claimed() -> None:
    w = WindowSlots(2, 4, window=4)
    w.claim_new(3)
    with pytest.raises(ValueError, match="still reads"):
        w.drop(3)
    w.release(3, keep=True)
    w.drop(3)  # the block was evicted from the pool: an id reused later starts without a part
    assert not w.has(3) and w.num_available() == 2
    with pytest.raises(ValueError, match="no claim"):
        w.release(3, keep=True)
    w.check_invariants()


def test_a_duplicate_block_hands_its_claim_to_the_cached_copy() -> None:
    w = WindowSlots(3, 4, window=4)
    w.claim_new(0)
    w.release(0, keep=True)  # the cached copy, its part idle
    w.claim_new(1)  # a table computed the same tokens again
    w.transfer(1, 0)
    assert w.claims[0] == 1 and not w.has(1)  # the copy's slot is freed, the cached part is claimed
    # a cached copy whose part was reclaimed takes the duplicate's slot instead
    w2 = WindowSlots(2, 3, window=4)
    w2.claim_new(0)
    w2.release(0, keep=True)
    w2.claim_new(1)
    w2.claim_new(2)  # reclaims block 0's part
    w2.transfer(2, 0)
    assert w2.has(0) and w2.claims[0] == 1 and not w2.has(2)
    w.check_invariants()
    w2.check_invariants()


def test_the_first_block_a_window_still_reads() -> None:
    w = WindowSlots(1, 1, window=12)
    assert [w.first_block(n, 4) for n in (0, 11, 12, 15, 16, 40)] == [0, 0, 0, 1, 1, 7]
    # at 16 tokens the next query (position 16) sees keys 5..16: block 1 (tokens 4..7) onwards


def test_random_walks_keep_the_invariants() -> None:
    rng = random.Random(7)
    w = WindowSlots(6, 12, window=8)
    claimed: list[int] = []
    for _ in range(3000):
        op = rng.randrange(5)
        b = rng.randrange(12)
        try:
            if op == 0 and not w.has(b):
                w.claim_new(b)
                claimed.append(b)
            elif op == 1 and claimed:
                w.release(claimed.pop(rng.randrange(len(claimed))), keep=rng.random() < 0.5)
            elif op == 2 and w.claim(b):
                claimed.append(b)
            elif op == 3 and w.claims[b] == 0:
                w.drop(b)
            elif op == 4 and w.lend(b) and w.claims[b] == 0 and rng.random() < 0.5:
                w.drop(b)
        except NoFreeSlotsError:
            assert w.num_available() == 0
        w.check_invariants()
        assert sorted(claimed) == sorted(b for b in range(12) for _ in range(w.claims[b]))

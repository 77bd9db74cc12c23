"""Host/disk block-file tiers: bytes survive every move, LRU demotion, pins, restart, bad files."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

from strata.kvstore import CacheGroup, FileBlockStore, KVLayout, LowerTiers

LAYOUT = KVLayout.uniform(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
FP = b"F" * 16


def block(i: int, layout: KVLayout = LAYOUT) -> np.ndarray:
    """Deterministic distinct payload for block ``i`` (uint8, device layout)."""
    g = torch.Generator().manual_seed(i)
    t = torch.randn(layout.bytes_per_block() // layout.dtype.itemsize, generator=g).to(layout.dtype)
    return t.view(torch.uint8).numpy().copy()


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def read(store: FileBlockStore | LowerTiers, i: int) -> np.ndarray | None:
    out = np.empty(LAYOUT.bytes_per_block(), dtype=np.uint8)
    ok = store.read_block(h(i), out) if isinstance(store, LowerTiers) else store.read_layers(h(i), out)
    return out if ok else None


def store(tmp_path: Path, capacity: int = 8, name: str = "host", **kw) -> FileBlockStore:
    return FileBlockStore(tmp_path / name, capacity, LAYOUT, FP, name=name, **kw)


def test_round_trip_whole_block_and_single_layers(tmp_path: Path) -> None:
    s = store(tmp_path)
    assert s.put(h(1), block(1))
    np.testing.assert_array_equal(read(s, 1), block(1))
    per = LAYOUT.bytes_per_block() // LAYOUT.num_layers
    for layer in range(LAYOUT.num_layers):
        out = np.empty(per, dtype=np.uint8)
        assert s.read_layers(h(1), out, layer, 1)
        np.testing.assert_array_equal(out, block(1)[layer * per : (layer + 1) * per])
    assert read(s, 2) is None and s.counters["misses"] == 1


def test_a_block_of_two_cache_groups_reads_back_one_layer_at_a_time(tmp_path: Path) -> None:
    """Groups differ in heads, width and dtype; a layer is read by its slot, checksummed alone."""
    lay = KVLayout((CacheGroup((0, 2), 2, 4), CacheGroup((1,), 1, 6, torch.bfloat16, kv_parts=1, window=8)), 4)
    s = FileBlockStore(tmp_path / "groups", 4, lay, FP)
    payload = np.random.default_rng(3).integers(0, 255, lay.bytes_per_block(), dtype=np.uint8)
    assert s.put(h(3), payload)
    for layer in range(3):
        slot = lay.slot_of(layer)
        a, b = lay.slot_offsets[slot], lay.slot_offsets[slot + 1]
        out = np.empty(b - a, dtype=np.uint8)
        assert s.read_layers(h(3), out, slot, 1)
        np.testing.assert_array_equal(out, payload[a:b])
    whole = np.empty(lay.bytes_per_block(), dtype=np.uint8)
    assert s.read_layers(h(3), whole) and np.array_equal(whole, payload)


def test_bfloat16_blocks_round_trip(tmp_path: Path) -> None:
    lay = KVLayout.uniform(2, 1, 8, 4, torch.bfloat16)
    s = FileBlockStore(tmp_path / "bf16", 4, lay, FP)
    payload = block(7, lay)
    s.put(h(7), payload)
    out = np.empty_like(payload)
    assert s.read_layers(h(7), out)
    np.testing.assert_array_equal(out, payload)


def test_lru_demotes_host_to_disk_and_disk_deletes(tmp_path: Path) -> None:
    tiers = LowerTiers.open(LAYOUT, FP, tmp_path / "host", 3, tmp_path / "disk", 4)
    assert tiers is not None
    host, disk = tiers.tiers
    tiers.store([(h(i), block(i)) for i in range(3)])
    tiers.touch([h(0)])  # block 0 is now the most recent; block 1 is the LRU victim
    tiers.store([(h(3), block(3))])
    assert not host.contains(h(1)) and disk.contains(h(1)) and host.contains(h(0))
    assert len(host) == 3 and host.counters["demoted"] == 1
    for i in range(4, 10):
        tiers.store([(h(i), block(i))])
    assert len(host) == 3 and len(disk) == 4  # capacities hold; the oldest fell off the end
    assert sum(tiers.find(h(i)) is not None for i in range(10)) == 7
    # every surviving block still has its exact bytes, wherever it ended up
    for i in range(10):
        got = read(tiers, i)
        assert got is None or np.array_equal(got, block(i))


def test_disk_hit_promotes_to_host(tmp_path: Path) -> None:
    tiers = LowerTiers.open(LAYOUT, FP, tmp_path / "host", 2, tmp_path / "disk", 8)
    assert tiers is not None
    host, disk = tiers.tiers
    tiers.store([(h(i), block(i)) for i in range(4)])  # 0 and 1 demoted to disk
    assert disk.contains(h(0)) and not host.contains(h(0))
    np.testing.assert_array_equal(read(tiers, 0), block(0))
    assert host.contains(h(0))


def test_pinned_blocks_are_never_evicted_and_capacity_still_holds(tmp_path: Path) -> None:
    s = store(tmp_path, capacity=2)
    s.put_many([(h(0), block(0)), (h(1), block(1))])
    s.pin([h(0), h(1)])
    assert s.put(h(2), block(2)) is False  # full of pinned blocks: rejected, not over capacity
    assert len(s) == 2 and s.counters["rejected"] == 1 and s.contains(h(0)) and s.contains(h(1))
    s.unpin([h(0)])
    assert s.put(h(2), block(2))
    assert not s.contains(h(0)) and s.contains(h(1)) and len(s) == 2


def test_pins_of_a_dead_process_are_dropped_at_open(tmp_path: Path) -> None:
    s = store(tmp_path, capacity=2)
    s.put(h(0), block(0))
    s.pin([h(0)], owner="999999999:dead")
    assert s.num_pinned() == 1
    assert store(tmp_path, capacity=2).num_pinned() == 0


def test_restart_rebuilds_the_index_from_the_files(tmp_path: Path) -> None:
    s = store(tmp_path, capacity=8, name="disk")
    s.put_many([(h(i), block(i)) for i in range(5)])
    s.close()
    os.unlink(s.files.path(h(4)))  # a file lost while we were down
    os.remove(tmp_path / "disk" / "index.db")  # and the index itself
    again = store(tmp_path, capacity=8, name="disk")
    assert len(again) == 4
    for i in range(4):
        np.testing.assert_array_equal(read(again, i), block(i))
    rows = sqlite3.connect(tmp_path / "disk" / "index.db").execute("SELECT COUNT(*) FROM blocks").fetchone()[0]
    assert rows == 4


def _corruptions(path: Path, tmp_path: Path) -> dict[str, callable]:
    def flip_payload() -> None:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))

    def truncate() -> None:
        path.write_bytes(path.read_bytes()[:-10])

    def foreign_layout() -> None:
        other = KVLayout.uniform(3, 2, 4, 4, torch.float16)
        FileBlockStore(tmp_path / "foreign", 2, other, FP).put(h(0), block(0, other))
        path.write_bytes(Path(FileBlockStore(tmp_path / "foreign", 2, other, FP).files.path(h(0))).read_bytes())

    def other_model() -> None:
        FileBlockStore(tmp_path / "other", 2, LAYOUT, b"G" * 16).put(h(0), block(0))
        path.write_bytes(Path(FileBlockStore(tmp_path / "other", 2, LAYOUT, b"G" * 16).files.path(h(0))).read_bytes())

    def garbage() -> None:
        path.write_bytes(b"not a block at all")

    def empty() -> None:
        path.write_bytes(b"")

    return {f.__name__: f for f in (flip_payload, truncate, foreign_layout, other_model, garbage, empty)}


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "foreign_layout", "other_model", "garbage", "empty"])
def test_bad_files_are_counted_misses_and_removed(tmp_path: Path, damage: str) -> None:
    s = store(tmp_path)
    s.put(h(0), block(0))
    _corruptions(Path(s.files.path(h(0))), tmp_path)[damage]()
    assert read(s, 0) is None  # no exception, no wrong bytes
    assert s.counters["corrupt"] == 1 and not s.contains(h(0)) and len(s) == 0
    assert s.put(h(0), block(0)) and np.array_equal(read(s, 0), block(0))  # and the slot is usable again


def test_a_corrupt_block_is_not_demoted(tmp_path: Path) -> None:
    tiers = LowerTiers.open(LAYOUT, FP, tmp_path / "host", 1, tmp_path / "disk", 4)
    assert tiers is not None
    host, disk = tiers.tiers
    tiers.store([(h(0), block(0))])
    data = bytearray(Path(host.files.path(h(0))).read_bytes())
    data[-1] ^= 1
    Path(host.files.path(h(0))).write_bytes(bytes(data))
    tiers.store([(h(1), block(1))])  # evicts 0, whose copy is bad
    assert not disk.contains(h(0)) and host.counters["corrupt"] == 1

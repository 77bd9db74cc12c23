"""Write-behind to the host/disk tiers: the step thread never writes a file, a queued block is not
reusable until it lands, what lands is what was published, and a full or failing writer costs caching,
never tokens."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import build, greedy
from strata.kvstore import BlockPool, FileBlockStore, KVLayout, LowerTiers, TieredKVCache
from strata.kvstore.tier_writer import TierWriter

LAYOUT = KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
FP = b"W" * 16


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _payload(i: int) -> np.ndarray:
    return np.full(LAYOUT.bytes_per_block(), i % 251, dtype=np.uint8)


def _tiers(tmp_path: Path, queue: int, capacity: int = 16) -> LowerTiers:
    return LowerTiers([FileBlockStore(tmp_path / "host", capacity, LAYOUT, FP)], write_queue_blocks=queue)


class _Gate:
    """A store that waits for ``open`` before writing: holds the writer thread mid-batch."""

    def __init__(self, tiers: LowerTiers) -> None:
        self.inner, self.open, self.entered = tiers._store_now, threading.Event(), threading.Event()

    def __call__(self, items, encoded):
        self.entered.set()
        assert self.open.wait(30)
        return self.inner(items, encoded)


def test_a_queued_block_is_a_copy_and_lands_in_the_background(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path, queue=8)
    gate = tiers.writer.store = _Gate(tiers)
    buf = _payload(1)
    tiers.store_behind([(_h(1), memoryview(buf))])
    assert gate.entered.wait(30)
    buf[:] = 0  # the device block is reused at once: what lands must not change
    assert tiers.find(_h(1)) is None, "not reusable from the tier before its write landed"
    gate.open.set()
    tiers.flush()
    out = np.empty(LAYOUT.bytes_per_block(), dtype=np.uint8)
    assert tiers.read_block(_h(1), out) and (out == 1).all()
    assert tiers.writer.counters["written"] == 1 and tiers.writer._thread.name == "kv-host-writer"
    tiers.close()


def test_a_full_queue_drops_caching_and_a_spill_writes_its_block_on_the_spot(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path, queue=2)
    gate = tiers.writer.store = _Gate(tiers)
    tiers.store_behind([(_h(1), _payload(1))])
    assert gate.entered.wait(30)  # block 1 in flight
    tiers.store_behind([(_h(i), _payload(i)) for i in (2, 3, 4)])
    assert tiers.writer.counters["dropped"] == 2 and tiers.stats()["host"]["write_queue_dropped"] == 2
    assert tiers.ensure(_h(2)), "a queued block a spill needs is written on the caller's thread"
    assert tiers.find(_h(2)) is not None and not tiers.writer.pending(_h(2))
    assert not tiers.ensure(_h(3)), "a dropped block is not below: the caller writes it from the device"
    gate.open.set()
    tiers.close()
    assert tiers.find(_h(1)) is not None and tiers.find(_h(3)) is None


def test_a_failing_store_leaves_the_writer_running(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path, queue=8)
    calls = []

    def flaky(items, encoded):
        calls.append(len(items))
        if len(calls) == 1:
            raise RuntimeError("disk on fire")
        return tiers._store_now(items, encoded)

    tiers.writer.store = flaky
    tiers.store_behind([(_h(1), _payload(1))])
    tiers.flush()
    tiers.store_behind([(_h(2), _payload(2))])
    tiers.flush()
    assert tiers.writer.counters["failed"] == 1 and tiers.writer.counters["written"] == 1
    assert tiers.find(_h(1)) is None and tiers.find(_h(2)) is not None
    tiers.close()


def test_a_hand_off_to_another_pool_waits_for_its_blocks(tmp_path: Path) -> None:
    tiers = _tiers(tmp_path, queue=64)
    gate = tiers.writer.store = _Gate(tiers)
    cache = TieredKVCache(BlockPool(LAYOUT, 16), tiers, 4, FP)
    table = cache.new_table()
    assert cache.reserve(table, 8)
    cache.commit(table, 8, [_h(10), _h(11)])
    assert gate.entered.wait(30)
    done = threading.Event()
    threading.Thread(target=lambda: (cache.make_handle(table, release=True), done.set()), daemon=True).start()
    assert not done.wait(0.3), "the handle must not leave before its blocks are below"
    gate.open.set()
    assert done.wait(30)
    assert tiers.find(_h(10)) is not None and tiers.find(_h(11)) is not None
    tiers.close()


def test_writer_refuses_a_queue_of_nothing() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        TierWriter(lambda items, encoded: [], 0)


def test_the_engine_step_writes_no_tier_file(llama_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """Publishing and the demotions to disk it causes happen on the writer thread; tokens equal an
    engine that writes on the step thread, and one whose queue holds a single block."""
    threads: list[str] = []
    real = FileBlockStore.put_many

    def spy(self, items, encoded=False):
        threads.append(threading.current_thread().name)
        return real(self, items, encoded)

    monkeypatch.setattr(FileBlockStore, "put_many", spy)
    tiers = dict(host_kv_blocks=8, host_kv_dir=str(tmp_path / "h"), disk_kv_blocks=64, disk_kv_dir=str(tmp_path / "d"))
    request = {"prompt": "Tell me about the tides, the moon and the long way home. " * 4, "params": greedy(12)}
    behind = build(llama_dir, **tiers)
    first = behind.generate([request])[0]
    behind.kv.lower.flush()
    assert threads and set(threads) == {"kv-host-writer"}
    assert behind.kv.lower.stats()["disk"]["puts"] > 0, "demotions happened, off the step"
    inline = build(llama_dir, kv_write_queue_blocks=0, **{**tiers, "host_kv_dir": str(tmp_path / "h2"),
                                                           "disk_kv_dir": str(tmp_path / "d2")})
    tiny = build(llama_dir, kv_write_queue_blocks=1, **{**tiers, "host_kv_dir": str(tmp_path / "h3"),
                                                         "disk_kv_dir": str(tmp_path / "d3")})
    assert inline.generate([request])[0].output_token_ids == first.output_token_ids
    assert tiny.generate([request])[0].output_token_ids == first.output_token_ids


def test_a_prefix_in_the_host_tier_is_read_ahead_while_the_step_before_runs(llama_dir: Path, tmp_path: Path,
                                                                            monkeypatch) -> None:
    """A prompt waiting its turn whose prefix another engine left in the host tier: its blocks are read on
    the read-ahead thread while the running request steps, and its admission takes them from memory (the
    step thread reads no file); the tokens equal an admission that reads the files itself."""
    from strata.kvstore import lower_tiers

    reads: list[str] = []
    real = lower_tiers.LowerTiers._read_block_now

    def spy(self, block_hash, out):
        reads.append(threading.current_thread().name)
        return real(self, block_hash, out)

    shared = "Tell me about the tides, the moon and the long way home. " * 6
    host = dict(host_kv_blocks=200, host_kv_dir=str(tmp_path / "host"), max_num_seqs=1)
    first = build(llama_dir, **host)  # another engine (process) leaves the prefix in the host tier
    first.generate([{"prompt": shared + "Begin.", "params": greedy(2)}])
    first.kv.lower.flush()
    monkeypatch.setattr(lower_tiers.LowerTiers, "_read_block_now", spy)
    waiting = {"prompt": shared + "Begin again.", "params": greedy(6)}
    plain = build(llama_dir, kv_prefetch_blocks=0, **host).generate([waiting])[0]
    assert plain.num_cached_tokens >= 64 and set(reads) == {"MainThread"}  # the files, on the step thread
    reads.clear()
    ahead = build(llama_dir, **host)
    # runs first (max_num_seqs=1), long enough that the read-ahead finishes on a loaded machine too
    ahead.add_request(prompt="Say something short.", params=greedy(24))
    rid = ahead.add_request(**waiting)
    out = [ev.token_id for ev in ahead.run() if ev.request_id == rid]
    assert out == plain.output_token_ids
    assert reads and set(reads) == {"kv-host-prefetch"}, reads
    assert ahead.kv.lower.prefetcher.counters["used"] == len(reads)

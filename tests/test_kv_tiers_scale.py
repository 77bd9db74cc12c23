"""The lower tiers across OS processes and at a million tokens (no model compute)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from strata.kvstore import FileBlockStore, KVLayout, LowerTiers

pytestmark = pytest.mark.slow  # child processes sharing the tiers

FP = b"F" * 16

_WRITER = textwrap.dedent(
    """
    import sys, numpy as np, torch
    from strata.kvstore import FileBlockStore, KVLayout
    root, cap, first, count, action = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    lay = KVLayout.uniform(2, 1, 4, 4, torch.float32)
    s = FileBlockStore(root, cap, lay, b"F" * 16)
    def payload(i):
        return np.full(lay.bytes_per_block(), i % 251, dtype=np.uint8)
    if action == "write":
        for i in range(first, first + count):
            s.put(i.to_bytes(16, "big"), payload(i))
    else:  # read: report which of the blocks are there with their exact bytes
        out = np.empty(lay.bytes_per_block(), dtype=np.uint8)
        good = [i for i in range(first, first + count) if s.read_layers(i.to_bytes(16, "big"), out) and (out == i % 251).all()]
        print(len(good))
    """
)


def _run(*args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WRITER, *map(str, args)], stdout=subprocess.PIPE, text=True,
                            cwd=tempfile.gettempdir())


def test_two_processes_share_blocks_and_the_capacity_holds(tmp_path: Path) -> None:
    root, cap = tmp_path / "host", 40
    # Two writers race on one tier, each with more blocks than it holds.
    writers = [_run(root, cap, 0, 100, "write"), _run(root, cap, 1000, 100, "write")]
    assert all(p.wait(timeout=120) == 0 for p in writers)
    lay = KVLayout.uniform(2, 1, 4, 4, torch.float32)
    s = FileBlockStore(root, cap, lay, FP)
    files = list((root / "blocks").rglob("*.kv"))
    assert len(s) == len(files) == cap
    # A third process reuses what the writers published: the newest blocks of each survive.
    reader = _run(root, cap, 0, 2000, "read")
    out, _ = reader.communicate(timeout=120)
    assert int(out) == cap


def test_a_block_written_by_one_process_is_read_by_another(tmp_path: Path) -> None:
    root = tmp_path / "host"
    assert _run(root, 16, 7, 3, "write").wait(timeout=60) == 0
    out, _ = _run(root, 16, 7, 3, "read").communicate(timeout=60)
    assert int(out) == 3


def _payload(i: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def test_a_million_tokens_of_kv_through_host_and_disk_with_bounded_memory(tmp_path: Path) -> None:
    """Write 1M tokens of KV (tiny layout: 64 B/token), look every block up and stream it back
    layer by layer, comparing bytes; Python-side memory stays far below the 64 MB written."""
    lay = KVLayout.uniform(num_layers=2, num_kv_heads=1, head_dim=8, block_size=256, dtype=torch.float16)
    tokens = 1_000_000
    nblocks = -(-tokens // lay.block_size)
    tiers = LowerTiers.open(lay, FP, tmp_path / "host", 1000, tmp_path / "disk", nblocks)
    assert tiers is not None
    host, disk = tiers.tiers
    nbytes = lay.bytes_per_block()
    tracemalloc.start()
    for first in range(0, nblocks, 64):  # publish in batches, as prefill chunks do
        tiers.store([(i.to_bytes(16, "big"), _payload(i, nbytes)) for i in range(first, min(nblocks, first + 64))])
    assert len(host) == 1000 and len(host) + len(disk) >= nblocks  # demoted, not dropped
    per_layer = nbytes // lay.num_layers
    stage = np.empty(per_layer, dtype=np.uint8)
    for i in range(nblocks):
        expected = _payload(i, nbytes)
        for layer in range(lay.num_layers):
            assert tiers.read_layers(i.to_bytes(16, "big"), stage, layer, 1), f"block {i} lost"
            assert np.array_equal(stage, expected[layer * per_layer : (layer + 1) * per_layer]), f"block {i} differs"
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert nblocks * nbytes >= 64_000_000
    assert peak < 6_000_000, f"peak traced memory {peak} bytes"
    assert host.counters["corrupt"] == disk.counters["corrupt"] == 0

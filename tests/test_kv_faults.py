"""The KV tiers when things go wrong: a torn index, dead processes' leftovers, a full disk, files that
vanish under running requests, and directories that are not ours. Blocks are served right or not at
all, requests finish or fail within bounds, and prompts stay private."""

from __future__ import annotations

import errno
import functools
import glob
import os
import random
import sqlite3
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from strata.kvstore import FileBlockStore, KVLayout
from helpers import build, greedy

LAYOUT = KVLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
FP = b"F" * 16


def _payload(i: int) -> np.ndarray:
    return np.full(LAYOUT.bytes_per_block(), i % 251, dtype=np.uint8)


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _read(s: FileBlockStore, i: int) -> bool:
    out = np.empty(LAYOUT.bytes_per_block(), dtype=np.uint8)
    return s.read_layers(_h(i), out) and bool((out == i % 251).all())


@pytest.mark.parametrize("damage", ["deleted", "garbage", "truncated"])
def test_a_torn_index_is_rebuilt_from_the_block_files(tmp_path: Path, damage: str) -> None:
    s = FileBlockStore(tmp_path / "host", 8, LAYOUT, FP)
    for i in range(3):
        s.put(_h(i), _payload(i))
    s.close()
    index = tmp_path / "host" / "index.db"
    if damage == "deleted":
        index.unlink()
    elif damage == "garbage":
        index.write_bytes(os.urandom(4096))
    else:
        index.write_bytes(index.read_bytes()[:100])
    reopened = FileBlockStore(tmp_path / "host", 8, LAYOUT, FP)
    assert len(reopened) == 3 and all(_read(reopened, i) for i in range(3))
    reopened.put(_h(7), _payload(7))
    assert _read(reopened, 7)


def test_temp_files_of_dead_processes_are_removed_at_open(tmp_path: Path) -> None:
    s = FileBlockStore(tmp_path / "host", 8, LAYOUT, FP)
    s.close()
    tmp = tmp_path / "host" / "tmp"
    (tmp / "999999999.deadbeef").write_bytes(b"half a block")  # a writer that died mid-write
    (tmp / f"{os.getpid()}.alive").write_bytes(b"ours")
    FileBlockStore(tmp_path / "host", 8, LAYOUT, FP)
    assert sorted(p.name for p in tmp.iterdir()) == [f"{os.getpid()}.alive"]


def test_an_index_entry_whose_file_vanished_is_stored_again(tmp_path: Path) -> None:
    """The index and the files disagree (a file deleted behind its back): the disk wins."""
    s = FileBlockStore(tmp_path / "host", 8, LAYOUT, FP)
    s.put(_h(1), _payload(1))
    os.unlink(s.files.path(_h(1)))
    assert s.put(_h(1), _payload(1)) and _read(s, 1)
    os.unlink(s.files.path(_h(1)))
    assert not _read(s, 1) and len(s) == 0 and s.counters["reconciled"] == 2


def test_tier_directories_and_files_are_private(tmp_path: Path) -> None:
    s = FileBlockStore(tmp_path / "host", 8, LAYOUT, FP)
    s.put(_h(1), _payload(1))
    for path in (tmp_path / "host", tmp_path / "host" / "blocks", Path(s.files.path(_h(1))).parent):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700, path
    for path in (s.files.path(_h(1)), tmp_path / "host" / "index.db"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match="writable by group or others"):
        FileBlockStore(shared, 8, LAYOUT, FP)
    readable = tmp_path / "readable"
    readable.mkdir()
    os.chmod(readable, 0o755)
    FileBlockStore(readable, 8, LAYOUT, FP)  # ours and not writable by others: tightened, not refused
    assert stat.S_IMODE(os.stat(readable).st_mode) == 0o700


def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to create a directory owned by someone else")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(PermissionError, match="another user"):
        FileBlockStore(theirs, 8, LAYOUT, FP)


def test_a_full_disk_costs_caching_never_tokens(llama_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """Every write to the host tier fails with ENOSPC: requests still give exactly the tokens of a run
    without tiers (blocks stay on the device or are recomputed), and the failures are counted."""
    rng = random.Random(3)
    requests = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(600)], "params": greedy(6)} for _ in range(3)]
    expected = build(llama_dir, max_model_len=800).generate(requests)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileBlockStore, "put_many", full)
    engine = build(llama_dir, max_model_len=800, num_kv_blocks=120, prefill_chunk_tokens=128,
                   max_num_batched_tokens=256, host_kv_blocks=400, host_kv_dir=str(tmp_path / "host"))
    outs = engine.generate(requests)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in expected]
    engine.kv.lower.flush()  # write-through runs behind the step
    assert engine.kv.lower.stats()["host"]["write_errors"] > 0


def test_host_files_vanishing_under_running_requests_never_livelock(llama_dir: Path, tmp_path: Path) -> None:
    """Requests sharing a prefix on a small device tier; half the host tier's files are deleted every few
    steps. Before the index reconciled with the disk this recomputed in a loop forever; now every request
    finishes, in a bounded number of steps, with the tokens of an all-on-device run."""
    rng = random.Random(0)
    shared = [rng.randrange(5, 500) for _ in range(800)]
    requests = [{"prompt_token_ids": shared + [rng.randrange(5, 500) for _ in range(100)], "params": greedy(8)}
                for _ in range(6)]
    expected = build(llama_dir, max_model_len=1200).generate(requests)
    host = tmp_path / "host"
    engine = build(llama_dir, max_model_len=1200, num_kv_blocks=48, prefill_chunk_tokens=128,
                   max_num_batched_tokens=256, host_kv_blocks=600, host_kv_dir=str(host))
    ids = [engine.add_request(**r) for r in requests]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    steps = 0
    while engine.has_unfinished():
        assert steps < 2000, "no progress: the requests are recomputing in a loop"
        for ev in engine.step():
            tokens[ev.request_id].append(ev.token_id)
        steps += 1
        if steps % 3 == 0:
            files = glob.glob(str(host / "blocks" / "*" / "*.kv"))
            for f in files[: len(files) // 2]:
                os.unlink(f)
    # A request that kept losing blocks may end with an error event (bounded retries); every other
    # request has exactly the tokens of the clean run.
    finished = [(tokens[i], o.output_token_ids) for i, o in zip(ids, expected) if -1 not in tokens[i]]
    assert len(finished) >= len(ids) // 2
    assert all(got == want for got, want in finished)
    assert engine.kv.lower.top.num_pinned() == 0


class _FullIndex:
    """The tier's SQLite connection on a filesystem that just filled: every COMMIT fails with
    SQLITE_FULL ("database or disk is full"), as a full /dev/shm gives it, and the transaction stays
    open until rolled back. ``room()`` frees the filesystem again."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db, self.full = db, True

    def execute(self, sql: str, *args):
        if self.full and sql == "COMMIT":
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self.db, name)


def _fill_index(s: FileBlockStore) -> _FullIndex:
    s.index.db = _FullIndex(s.index.db)  # type: ignore[assignment]
    return s.index.db  # type: ignore[return-value]


def _files(s: FileBlockStore) -> set[bytes]:
    return {bytes.fromhex(Path(p).stem) for p in glob.glob(str(s.root / "blocks" / "*" / "*.kv"))}


def test_a_full_index_fails_the_write_whole_and_leaves_files_and_index_agreeing(tmp_path: Path) -> None:
    """The defect: a failed SQLite commit escaped write-through and failed the step. Now it is a
    TierWriteError (an OSError, which write-through treats as 'not cached'), the new files are taken
    back out and the evicted ones put back, and the store keeps answering."""
    from strata.kvstore.file_store import TierWriteError

    disk = FileBlockStore(tmp_path / "disk", 64, LAYOUT, FP, name="disk")
    s = FileBlockStore(tmp_path / "host", 4, LAYOUT, FP, demote=functools.partial(disk.put_many, encoded=True))
    for i in range(4):
        assert s.put(_h(i), _payload(i))
    s.pin([_h(0)])
    index = _fill_index(s)
    with pytest.raises(TierWriteError, match="full"):
        s.put_many([(_h(i), _payload(i)) for i in range(10, 40)])  # would evict 1..3 and add new blocks
    assert _files(s) == {_h(i) for i in range(4)}, "files agree with the index as it was"
    assert all(_read(s, i) for i in range(4)) and len(s) == 4
    assert not os.listdir(tmp_path / "host" / "tmp"), "no temp file left behind"
    s.touch([_h(1)])  # index writes degrade quietly ...
    s.pin([_h(2)])
    s.unpin([_h(0)])  # ... and an unpin the index refused is kept and retried
    assert s.counters["index_errors"] == 3 and s.writes.owed_unpins
    index.full = False  # room again (the filesystem was cleaned up)
    assert s.put(_h(50), _payload(50))
    assert not s.writes.owed_unpins and s.num_pinned() == 0, "the pending unpin landed with the next write"


def test_write_through_survives_a_full_index(llama_dir: Path, tmp_path: Path) -> None:
    """Through the whole engine: the host tier's index refuses every commit; requests give the tokens of
    a run without tiers and the failures are counted."""
    rng = random.Random(4)
    requests = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(300)], "params": greedy(6)} for _ in range(3)]
    expected = build(llama_dir, max_model_len=800).generate(requests)
    engine = build(llama_dir, max_model_len=800, num_kv_blocks=120, prefill_chunk_tokens=128,
                   max_num_batched_tokens=256, host_kv_blocks=400, host_kv_dir=str(tmp_path / "host"))
    _fill_index(engine.kv.lower.top)
    outs = engine.generate(requests)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in expected]
    assert all(o.error is None for o in outs)
    engine.kv.lower.flush()
    assert engine.kv.lower.stats()["host"]["write_errors"] > 0


def test_a_planted_symlink_tier_directory_is_refused(tmp_path: Path) -> None:
    """In a world-writable parent (/dev/shm) another user can plant strata-kv-<uid> -> a directory of the
    victim's. Following it would write the victim's prompts there; the tier refuses instead."""
    victims_dir = tmp_path / "victims-own-dir"
    victims_dir.mkdir(mode=0o700)
    planted = tmp_path / "strata-kv-planted"
    planted.symlink_to(victims_dir)
    with pytest.raises(PermissionError, match="symbolic link"):
        FileBlockStore(planted, 8, LAYOUT, FP)
    assert list(victims_dir.iterdir()) == [], "nothing was written through the link"


def test_a_path_through_another_users_symlink_is_refused(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to create a link owned by someone else")
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    os.lchown(link, 12345, 12345)
    with pytest.raises(PermissionError, match="another user owns"):
        FileBlockStore(link / "host", 8, LAYOUT, FP)
    own = tmp_path / "own-link"
    own.symlink_to(target)
    FileBlockStore(own / "host", 8, LAYOUT, FP)  # the user's own link (or root's) is their layout

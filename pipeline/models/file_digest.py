"""SHA-256 of large files, computed once per file version and remembered across processes.

The KV fingerprint needs a digest of the weights' *content*: two fine-tunes of one base have the
same shard names and sizes, so anything cheaper lets one model serve another's KV. Reading a
checkpoint end to end is slow (minutes for hundreds of GB), so each file's digest is kept in a small
record under ``~/.cache/strata/digests`` (``STRATA_DIGEST_CACHE`` overrides), keyed by the file's
resolved path and trusted only while its size, mtime, ctime and inode are unchanged: rewriting,
replacing or touching a shard makes it hash again. The directory is 0700 and records 0600 (they name
the user's model paths); a record that is unreadable or stale is just recomputed.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from pathlib import Path

CHUNK = 1 << 20
MAX_RECORDS = 4096  # past this many records, those of files that no longer exist are pruned
_lock = threading.Lock()
_memo: dict[tuple, str] = {}  # this process: (path, size, mtime, ctime, inode) -> digest


def cache_root() -> Path:
    return Path(os.environ.get("STRATA_DIGEST_CACHE") or Path.home() / ".cache" / "strata" / "digests")


def _version(path: Path) -> tuple[str, int, int, int, int]:
    real = os.path.realpath(path)
    st = os.stat(real)
    return real, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _record_path(real: str) -> Path:
    return cache_root() / (hashlib.sha256(real.encode()).hexdigest()[:32] + ".json")


def _read_record(version: tuple) -> str | None:
    try:
        record = json.loads(_record_path(version[0]).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(record, dict) and record.get("version") == list(version) and isinstance(record.get("sha256"), str):
        return record["sha256"]
    return None


def _write_record(version: tuple, digest: str) -> None:
    """Best effort: a cache that cannot be written (read-only home, full disk) only costs a re-hash."""
    root = cache_root()
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        tmp = root / f".{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"version": list(version), "sha256": digest}, fh)
        os.replace(tmp, _record_path(version[0]))
        records = list(root.glob("*.json"))
        if len(records) > MAX_RECORDS:
            _prune(records)
    except OSError:
        pass


def _prune(records: list[Path]) -> None:
    """Forget files that are gone (test checkpoints, deleted models): the cache stays small."""
    for record in records:
        try:
            if not os.path.exists(json.loads(record.read_text())["version"][0]):
                record.unlink()
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            record.unlink(missing_ok=True)


def remember(path: str | Path, digest: str, version: tuple | None = None) -> None:
    """Record a digest computed elsewhere (the loader's manifest check reads each shard anyway).
    ``version`` is the file's identity from before it was read, so a file changed meanwhile is not
    recorded under its new identity."""
    version = version or _version(Path(path))
    with _lock:
        _memo[version] = digest
    _write_record(version, digest)


def file_identity(path: str | Path) -> tuple:
    return _version(Path(path))


def hash_file(path: str | Path) -> str:
    """The file's SHA-256 read from disk (no cache)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: str | Path) -> str:
    """The file's SHA-256, from the cache when this exact file version was hashed before."""
    version = _version(Path(path))
    with _lock:
        cached = _memo.get(version)
    if cached is None:
        cached = _read_record(version)
    if cached is None:
        cached = hash_file(path)
        if _version(Path(path)) == version:  # not changed while we read it
            _write_record(version, cached)
    with _lock:
        _memo[version] = cached
    return cached

"""The shared SQLite index of one tier directory (``index.db``, WAL mode): each block's last access (the
LRU order), the block count and the pins, for every process that opens the tier.

Its write transactions (``BEGIN IMMEDIATE``) take the database's write lock up front, so the
read-check-write of a capacity decision cannot interleave with another process's. It only caches what
the block files say: a file that is not a usable database (torn by a crash, overwritten) is recreated,
and ``reconcile`` makes it agree with the files, so nothing is ever lost with it. Callers in one process
share one connection and serialize on their own lock (``FileBlockStore``).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Iterable

from strata.kvstore.liveness import pid_alive
from strata.kvstore.private_dir import private_file

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (hash BLOB PRIMARY KEY, last_access REAL NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_lru ON blocks(last_access);
CREATE TABLE IF NOT EXISTS pins (hash BLOB NOT NULL, owner TEXT NOT NULL, PRIMARY KEY (hash, owner)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


class TierIndex:
    """Blocks (hash -> last access), their count, and pins (hash, owner ``pid:tag``) of one tier."""

    def __init__(self, path: Path, tier_name: str) -> None:
        self.path, self.tier_name = path, tier_name
        self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        for attempt in range(2):
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
            try:
                _setup(db)
                db.execute("SELECT count(*) FROM blocks").fetchone()
                private_file(self.path)
                return db
            except sqlite3.DatabaseError as exc:
                db.close()
                if attempt:
                    raise
                log.warning("KV %s tier index at %s is unreadable (%s); rebuilding it from the block files",
                            self.tier_name, self.path.parent, exc)
                for suffix in ("", "-wal", "-shm"):
                    try:
                        os.unlink(str(self.path) + suffix)
                    except FileNotFoundError:
                        pass
        raise AssertionError("unreachable")

    def transaction(self) -> "Transaction":
        return Transaction(self.db)

    # ------------------------------------------------------------ inside a write transaction
    def count(self) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key='count'").fetchone()
        return int(row[0]) if row else 0

    def set_count(self, n: int) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES ('count', ?)", (n,))

    def has(self, block_hash: bytes) -> bool:
        return self.db.execute("SELECT 1 FROM blocks WHERE hash=?", (block_hash,)).fetchone() is not None

    def insert(self, block_hash: bytes, when: float) -> None:
        self.db.execute("INSERT INTO blocks VALUES (?, ?)", (block_hash, when))

    def delete(self, block_hash: bytes) -> bool:
        """Drop a block's entry (the count is the caller's to keep); whether there was one."""
        return bool(self.db.execute("DELETE FROM blocks WHERE hash=?", (block_hash,)).rowcount)

    def remove(self, block_hash: bytes) -> bool:
        """Drop a block's entry and count it out; whether there was one."""
        if not self.delete(block_hash):
            return False
        self.set_count(self.count() - 1)
        return True

    def touch(self, hashes: Iterable[bytes], when: float) -> None:
        self.db.executemany("UPDATE blocks SET last_access=? WHERE hash=?", ((when, h) for h in hashes))

    def oldest_unpinned(self) -> bytes | None:
        """The least recently used block nobody pins: the next to evict."""
        row = self.db.execute(
            "SELECT hash FROM blocks WHERE NOT EXISTS (SELECT 1 FROM pins WHERE pins.hash=blocks.hash)"
            " ORDER BY last_access LIMIT 1"
        ).fetchone()
        return bytes(row[0]) if row is not None else None

    def reconcile(self, present: dict[bytes, float]) -> None:
        """Agree with the files (hash -> mtime): forget blocks that are gone, add blocks that are there,
        set the count, and drop the pins of processes that are dead."""
        indexed = {bytes(r[0]) for r in self.db.execute("SELECT hash FROM blocks")}
        self.db.executemany("DELETE FROM blocks WHERE hash=?", ((h,) for h in indexed - present.keys()))
        self.db.executemany("INSERT OR IGNORE INTO blocks VALUES (?, ?)",
                            ((h, t) for h, t in present.items() if h not in indexed))
        self.set_count(len(present))
        owners = {r[0] for r in self.db.execute("SELECT DISTINCT owner FROM pins")}
        dead = [o for o in owners if o.split(":", 1)[0].isdigit() and not pid_alive(int(o.split(":", 1)[0]))]
        self.db.executemany("DELETE FROM pins WHERE owner=?", ((o,) for o in dead))

    def add_pins(self, rows: list[tuple[bytes, str]]) -> None:
        self.db.executemany("INSERT OR IGNORE INTO pins VALUES (?, ?)", rows)

    def delete_pins(self, rows: list[tuple[bytes, str]]) -> None:
        self.db.executemany("DELETE FROM pins WHERE hash=? AND owner=?", rows)

    def delete_owner(self, owner: str) -> None:
        self.db.execute("DELETE FROM pins WHERE owner=?", (owner,))

    # ------------------------------------------------------------ reads
    def num_pinned(self) -> int:
        return int(self.db.execute("SELECT COUNT(DISTINCT hash) FROM pins").fetchone()[0])

    def close(self) -> None:
        self.db.close()


def _setup(db: sqlite3.Connection) -> None:
    """WAL mode and schema. Switching the journal mode takes a lock that SQLite's busy timeout does not
    wait for, so processes opening the store together retry it."""
    for attempt in range(100):
        try:
            db.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError:
            if attempt == 99:
                raise
            time.sleep(0.05)
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(_SCHEMA)


class Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error): takes the write lock up front, so the
    read-check-write of a capacity decision cannot interleave with another process."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
                return
            except sqlite3.Error:  # e.g. "database or disk is full": SQLite may keep the transaction open
                self._rollback()
                raise
        self._rollback()

    def _rollback(self) -> None:
        if self.db.in_transaction:
            try:
                self.db.execute("ROLLBACK")
            except sqlite3.Error:
                pass

"""Where one tier's block files lie: ``blocks/<2 hex>/<hash>.kv``, each written whole under ``tmp/`` first and
renamed into place, so a reader sees a whole file or none. Directories are 0700 and files 0600: a block
holds a prompt's KV."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable, Iterable

from strata.kvstore.liveness import pid_alive
from strata.kvstore.private_dir import private_dir


def unlink(path: str) -> None:
    """Remove a file that may already be gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class BlockFiles:
    """The paths of a tier's block files and the staging of new ones."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blocks_dir = str(root / "blocks")
        self.tmp_dir = str(root / "tmp")
        for d in (root, Path(self.blocks_dir), Path(self.tmp_dir)):
            private_dir(d)

    def path(self, block_hash: bytes) -> str:
        # Plain strings, not pathlib: pathlib interns every component, which grows with the blocks seen.
        h = block_hash.hex()
        return os.path.join(self.blocks_dir, h[:2], h + ".kv")

    def tmp_path(self) -> str:
        """A fresh temp file name, prefixed by this pid so a dead writer's leftovers can be swept."""
        return os.path.join(self.tmp_dir, f"{os.getpid()}.{uuid.uuid4().hex}")

    def stage(self, items: Iterable[tuple[bytes, bytes | memoryview]],
              encode: Callable[[bytes, bytes | memoryview], bytes | memoryview]) -> list[tuple[bytes, str]]:
        """Write each block's file under ``tmp/`` (0600); (hash, temp path) pairs. On an OSError nothing
        is left behind and the error is raised."""
        staged: list[tuple[bytes, str]] = []
        try:
            for block_hash, data in items:
                tmp = self.tmp_path()
                staged.append((block_hash, tmp))
                with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(encode(block_hash, data))
        except OSError:
            for _, tmp in staged:
                unlink(tmp)
            raise
        return staged

    def sweep_dead_writers(self) -> None:
        """Remove temp files whose writing process is gone."""
        for entry in os.scandir(self.tmp_dir):
            pid = entry.name.split(".", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                unlink(entry.path)

    def scan(self) -> dict[bytes, float]:
        """Every block file present, with its modification time."""
        present: dict[bytes, float] = {}
        for sub in os.scandir(self.blocks_dir):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(".kv"):
                    try:
                        present[bytes.fromhex(entry.name[:-3])] = entry.stat().st_mtime
                    except (ValueError, FileNotFoundError):
                        continue
        return present

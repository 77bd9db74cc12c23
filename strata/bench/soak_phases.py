"""The hostile phases of `strata bench soak`: uploads that stall, and a host tier whose filesystem fills.

Both attack what the mixed traffic cannot reach: a client that sends headers and a few bytes of body,
then nothing (each must get a 408 once its body deadline passes, and lock no one else out), and a host
tier on a filesystem with no space left (every request must still be answered; only caching is lost).
The tier is a small tmpfs of the soak's own, filled with a ballast file, so the machine's /dev/shm is
never touched; mounting needs root, and without it the phase is reported as skipped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections import Counter
from pathlib import Path


class Staller:
    """While running, keeps ``sockets`` uploads stalled at once; counts how each ended (``slowbody:408``
    is the expected answer)."""

    def __init__(self, base_url: str, sockets: int = 4, wait_s: float = 120.0) -> None:
        host, port = base_url.removeprefix("http://").rsplit(":", 1)
        self.address = (host, int(port))
        self.sockets, self.wait_s = sockets, wait_s
        self.outcomes: Counter[str] = Counter()
        self.stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def join(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.wait_s + 30)

    def _run(self) -> None:
        while not self.stop.is_set():
            threads = [threading.Thread(target=self._one, daemon=True) for _ in range(self.sockets)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    def _one(self) -> None:
        try:
            with socket.create_connection(self.address, timeout=self.wait_s) as sock:
                sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: {self.address[0]}\r\n"
                             "content-type: application/json\r\ncontent-length: 2048\r\n\r\n{\"model\": ".encode())
                head = b""
                while b"\r\n" not in head:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    head += chunk
            status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else "closed"
        except OSError as exc:
            status = type(exc).__name__
        self.outcomes[f"slowbody:{status}"] += 1


class TierBallast:
    """A tmpfs of ``size_mb`` for the host tier, and a ballast file that fills it on demand."""

    def __init__(self, directory: Path, size_mb: int) -> None:
        self.directory = directory
        self.size_mb = size_mb
        self.mounted = False
        self.skipped: str | None = None
        self.ballast = directory / "ballast"

    def mount(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0700", "tmpfs",
                               str(self.directory)], capture_output=True, text=True)
        if done.returncode != 0:
            self.skipped = "mounting a tmpfs for the host tier needs root"
            return
        self.mounted = True

    def fill(self) -> int:
        """Write the ballast until the filesystem has no space left; the bytes written."""
        if not self.mounted:
            return 0
        written = 0
        block = b"\0" * (1 << 16)
        fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                try:
                    written += os.write(fd, block)
                except OSError:  # ENOSPC: full
                    return written
        finally:
            os.close(fd)

    def empty(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.directory)], capture_output=True)
            self.mounted = False

"""Directories and files of the KV tiers that only their owner can reach.

KV blocks are users' prompts in another form, so a tier directory is created 0700 and its files
0600, and a directory that is not plainly ours (another user's, writable by others, a symbolic link,
or reached through a link someone else planted) is refused rather than written into.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def private_dir(path: Path) -> None:
    """Create ``path`` 0700, or accept an existing one only if this user owns it and nobody else can write
    it: KV blocks hold users' prompts, and a directory others control could feed us their blocks or
    receive ours. The directory itself must not be a symbolic link, and no component of its path may be
    a link another user owns: in a world-writable parent such as /dev/shm anyone can plant
    ``strata-kv-<uid>`` pointing at a directory of the victim's, and following it would write the
    victim's prompts (or read planted blocks) somewhere they did not choose."""
    _refuse_foreign_links(path)
    os.makedirs(path, mode=0o700, exist_ok=True)
    _refuse_foreign_links(path)  # makedirs follows links: look again now that every component exists
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise PermissionError(f"KV tier directory {path} cannot be opened as a plain directory "
                              f"({exc.strerror}); choose a directory of your own") from None
    try:
        info = os.fstat(fd)  # the directory actually opened, not whatever the name points at later
        if info.st_uid != os.getuid():
            raise PermissionError(f"KV tier directory {path} belongs to another user (uid {info.st_uid}); "
                                  "choose a directory of your own")
        if info.st_mode & 0o022:
            raise PermissionError(f"KV tier directory {path} is writable by group or others; "
                                  f"chmod 0700 it or choose another directory")
        if info.st_mode & 0o077:
            os.fchmod(fd, 0o700)  # readable by others: tighten it (ours, not writable by them)
    finally:
        os.close(fd)


def _refuse_foreign_links(path: Path) -> None:
    """No symbolic link as the directory itself, and none owned by another user on the way to it
    (links owned by root or by us are the system's or the user's own layout)."""
    full = Path(os.path.abspath(path))
    current = Path(full.anchor)
    for i, part in enumerate(full.parts[1:], 1):
        current = current / part
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            return
        if not stat.S_ISLNK(info.st_mode):
            continue
        if i == len(full.parts) - 1:
            raise PermissionError(f"KV tier directory {path} is a symbolic link; give the real directory")
        if info.st_uid not in (os.getuid(), 0):
            raise PermissionError(f"KV tier directory {path} goes through a symbolic link another user owns "
                                  f"({current}); choose a directory of your own")


def private_file(path: Path | str) -> None:
    for suffix in ("", "-wal", "-shm"):
        try:
            os.chmod(str(path) + suffix, 0o600)
        except FileNotFoundError:
            pass

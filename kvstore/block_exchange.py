"""Blocks between nodes: what a hand-off from another node must bring, the verified files this node's
block server sends, and the received files stored after verifying each one again.

A receiver trusts nothing it is sent: every file is checked against the block it claims to be, the
model's fingerprint and the layout before it enters a tier, and a rejected block is recomputed.
"""

from __future__ import annotations

from typing import Sequence

from strata.kvstore.block_file import BlockFileError, verify_blob
from strata.kvstore.file_store import TierWriteError
from strata.kvstore.lower_tiers import LowerTiers


def missing_blocks(lower: LowerTiers, hashes: Sequence[bytes]) -> list[bytes]:
    """The blocks no tier here holds (what a hand-off from another node must bring along)."""
    return [h for h in hashes if lower.find(h) is None]


def export_blocks(lower: LowerTiers, hashes: Sequence[bytes]) -> list[bytes | None]:
    """Whole verified block files, from the first tier holding a good copy (None where none does):
    what this node's block server sends to another node."""
    out = []
    for h in hashes:
        out.append(next((blob for t in lower.tiers if (blob := t.read_encoded(h)) is not None), None))
    return out


def import_blocks(lower: LowerTiers, items: Sequence[tuple[bytes, bytes | None]],
                  fingerprint: bytes) -> tuple[int, int]:
    """Store block files received from another node in the top tier, each verified first (header
    names the block, model and layout; every layer's checksum holds). Returns (stored, rejected);
    a rejected or absent block is simply not here, and its reader recomputes it."""
    good, rejected = [], 0
    for block_hash, blob in items:
        if blob is None:
            continue
        try:
            verify_blob(blob, block_hash, fingerprint, lower.layout)
        except BlockFileError:
            rejected += 1
            continue
        good.append((block_hash, blob))
    try:
        stored = sum(lower.top.put_many(good, encoded=True)) if good else 0
    except TierWriteError:  # a full tier here: the reader recomputes what was not stored
        lower.write_errors += 1
        stored = 0
    return stored, rejected

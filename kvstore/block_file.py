"""On-disk format of one KV block, shared by the host (tmpfs) and disk tiers.

A file is a fixed header followed by the block payload: its cache groups in order, each
``[group layers, kv_parts, block_size, kv_heads, head_dim]`` (``KVLayout.slot_offsets``), so one layer's K and
V (or MLA latent) are one contiguous byte range: attention over tiers reads a single layer with one ``pread``.

Header (little endian), then msgpack metadata, then payload::

    magic b"STKV" | u16 format version | u32 metadata length | metadata | payload

metadata = {block hash, fingerprint, layout, payload length, crc32 per layer}. A CRC per
layer lets a one-layer read verify exactly the bytes it returns. Anything that does not
match what the reader expects is reported as :class:`BlockFileError`, which the stores
turn into a counted miss: a bad file is never served as KV.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np

from strata.kvstore.layout import KVLayout

MAGIC = b"STKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHI")  # magic, version, metadata length
_MAX_META = 1 << 20


class BlockFileError(ValueError):
    """A block file that must not be used: corrupt, truncated, foreign or from another model."""


@dataclass(frozen=True)
class BlockFileInfo:
    """What a reader learns from a header: enough to locate and verify any slot (a layer of a group)."""

    block_hash: bytes
    payload_offset: int
    slot_offsets: tuple[int, ...]  # byte offset of each slot in the payload, then the payload's size
    layer_crcs: tuple[int, ...]

    def span(self, first: int, count: int) -> tuple[int, int]:
        """(payload offset, bytes) of ``count`` slots from ``first``."""
        return self.slot_offsets[first], self.slot_offsets[first + count] - self.slot_offsets[first]


def encode_block(block_hash: bytes, fingerprint: bytes, layout: KVLayout, payload: memoryview | bytes) -> bytes:
    """Header + payload for ``payload`` (the raw bytes of one block, its groups in order)."""
    offsets = layout.slot_offsets
    view = memoryview(payload).cast("B")
    if len(view) != offsets[-1]:
        raise ValueError(f"payload is {len(view)} bytes, layout needs {offsets[-1]}")
    crcs = [zlib.crc32(view[a:b]) for a, b in zip(offsets, offsets[1:])]
    meta = msgpack.packb(
        {"hash": block_hash, "fingerprint": fingerprint, "layout": layout.to_dict(), "nbytes": len(view), "crc": crcs},
        use_bin_type=True,
    )
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(meta)) + meta + view.tobytes()


def read_header(fd: int, block_hash: bytes, fingerprint: bytes, layout: KVLayout) -> BlockFileInfo:
    """Parse and check the header of an open block file against what the reader expects."""
    return _parse_header(lambda n, offset: os.pread(fd, n, offset), os.fstat(fd).st_size, block_hash, fingerprint, layout)


def verify_blob(blob: bytes, block_hash: bytes, fingerprint: bytes, layout: KVLayout) -> None:
    """Check a whole block file held in memory (one that came over the network): its header is the
    block the reader asked for, and every layer's checksum holds. Raises BlockFileError if not."""
    info = _parse_header(lambda n, offset: blob[offset : offset + n], len(blob), block_hash, fingerprint, layout)
    view = memoryview(blob)[info.payload_offset :]
    for i, (crc, a, b) in enumerate(zip(info.layer_crcs, info.slot_offsets, info.slot_offsets[1:])):
        if zlib.crc32(view[a:b]) != crc:
            raise BlockFileError(f"checksum mismatch in layer {i}")


def _parse_header(read_at, size: int, block_hash: bytes, fingerprint: bytes, layout: KVLayout) -> BlockFileInfo:
    head = read_at(_PREFIX.size, 0)
    if len(head) < _PREFIX.size:
        raise BlockFileError("truncated header")
    magic, version, meta_len = _PREFIX.unpack(head)
    if magic != MAGIC:
        raise BlockFileError("not a Strata KV block file")
    if version != FORMAT_VERSION:
        raise BlockFileError(f"unsupported block file version {version}")
    if meta_len > _MAX_META:
        raise BlockFileError("metadata too large")
    raw = read_at(meta_len, _PREFIX.size)
    if len(raw) != meta_len:
        raise BlockFileError("truncated metadata")
    try:
        meta = msgpack.unpackb(raw, raw=False)
        file_layout, stored_hash, stored_fp = meta["layout"], meta["hash"], meta["fingerprint"]
        nbytes, crcs = meta["nbytes"], meta["crc"]
    except Exception as exc:  # any malformed metadata is a bad file, whatever the exception
        raise BlockFileError(f"malformed metadata: {exc}") from exc
    if stored_hash != block_hash:
        raise BlockFileError("file holds another block")
    if stored_fp != fingerprint:
        raise BlockFileError("file was written for another model")
    if file_layout != layout.to_dict():
        raise BlockFileError(f"foreign layout {file_layout}")
    offsets = layout.slot_offsets
    if nbytes != offsets[-1] or len(crcs) != layout.num_layers:
        raise BlockFileError("payload size disagrees with layout")
    offset = _PREFIX.size + meta_len
    if size != offset + nbytes:
        raise BlockFileError("truncated payload")
    return BlockFileInfo(stored_hash, offset, offsets, tuple(int(c) for c in crcs))


def read_layers_into(fd: int, info: BlockFileInfo, out: np.ndarray, first_slot: int, num_slots: int) -> None:
    """Read ``num_slots`` slots (layers, in block order) from ``first_slot`` into the uint8 array ``out`` and
    verify them."""
    start, nbytes = info.span(first_slot, num_slots)
    view = memoryview(out).cast("B")
    if len(view) != nbytes:
        raise ValueError(f"destination holds {len(view)} bytes, need {nbytes}")
    got = os.preadv(fd, [view], info.payload_offset + start)
    if got != nbytes:
        raise BlockFileError("short read")
    for i in range(first_slot, first_slot + num_slots):
        a, b = info.slot_offsets[i] - start, info.slot_offsets[i + 1] - start
        if zlib.crc32(view[a:b]) != info.layer_crcs[i]:
            raise BlockFileError(f"checksum mismatch in layer {i}")

"""On-disk format of one KV block, shared by the host (tmpfs) and disk tiers.

A file is a fixed header followed by the block payload in the device layout
``[num_layers, kv_parts, block_size, kv_heads, head_dim]``, so one layer's K and V (or MLA latent) are one
contiguous byte range: attention over tiers reads a single layer with one ``pread``.

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
    """What a reader learns from a header: enough to locate and verify any layer."""

    block_hash: bytes
    payload_offset: int
    layer_bytes: int
    layer_crcs: tuple[int, ...]


def layer_nbytes(layout: KVLayout) -> int:
    """Bytes of one layer's K and V (or latent) in one block."""
    return layout.kv_parts * layout.block_size * layout.num_kv_heads * layout.head_dim * layout.itemsize


def encode_block(block_hash: bytes, fingerprint: bytes, layout: KVLayout, payload: memoryview | bytes) -> bytes:
    """Header + payload for ``payload`` (the raw bytes of one block in device layout)."""
    per_layer = layer_nbytes(layout)
    view = memoryview(payload).cast("B")
    if len(view) != per_layer * layout.num_layers:
        raise ValueError(f"payload is {len(view)} bytes, layout needs {per_layer * layout.num_layers}")
    crcs = [zlib.crc32(view[i * per_layer : (i + 1) * per_layer]) for i in range(layout.num_layers)]
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
    for i, crc in enumerate(info.layer_crcs):
        if zlib.crc32(view[i * info.layer_bytes : (i + 1) * info.layer_bytes]) != crc:
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
    per_layer = layer_nbytes(layout)
    if nbytes != per_layer * layout.num_layers or len(crcs) != layout.num_layers:
        raise BlockFileError("payload size disagrees with layout")
    offset = _PREFIX.size + meta_len
    if size != offset + nbytes:
        raise BlockFileError("truncated payload")
    return BlockFileInfo(stored_hash, offset, per_layer, tuple(int(c) for c in crcs))


def read_layers_into(fd: int, info: BlockFileInfo, out: np.ndarray, first_layer: int, num_layers: int) -> None:
    """Read ``num_layers`` layers starting at ``first_layer`` into the uint8 array ``out`` and verify them."""
    nbytes = info.layer_bytes * num_layers
    view = memoryview(out).cast("B")
    if len(view) != nbytes:
        raise ValueError(f"destination holds {len(view)} bytes, need {nbytes}")
    got = os.preadv(fd, [view], info.payload_offset + first_layer * info.layer_bytes)
    if got != nbytes:
        raise BlockFileError("short read")
    for i in range(num_layers):
        chunk = view[i * info.layer_bytes : (i + 1) * info.layer_bytes]
        if zlib.crc32(chunk) != info.layer_crcs[first_layer + i]:
            raise BlockFileError(f"checksum mismatch in layer {first_layer + i}")

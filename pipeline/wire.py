"""The one msgpack encoding of the request contract (requests, hand-offs, token events).

numpy arrays travel as a msgpack extension (dtype, shape, raw bytes), so image embeddings cross
stage boundaries as bytes, never as pickled tensors. Everything else is builtins.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

_NDARRAY = 1  # msgpack extension code of a numpy array


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return msgpack.ExtType(_NDARRAY, msgpack.packb([arr.dtype.str, list(arr.shape), arr.tobytes()]))
    raise TypeError(f"cannot encode {type(obj).__name__} on the wire")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _NDARRAY:
        return msgpack.ExtType(code, data)
    dtype, shape, raw = msgpack.unpackb(data)
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()  # writable, owns its memory


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def message(kind: str, version: int, **fields: Any) -> bytes:
    """A versioned message of one kind (``request``, ``handoff``, ``events``)."""
    return pack({"kind": kind, "v": version, **fields})


def open_message(data: bytes, kind: str, version: int) -> dict[str, Any]:
    """The fields of a message of ``kind`` at ``version``, or ValueError saying what arrived instead."""
    obj = unpack(data)
    if not isinstance(obj, dict) or obj.get("kind") != kind or obj.get("v") != version:
        found = (obj.get("kind"), obj.get("v")) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"expected a {kind} message version {version}, got {found!r}")
    return obj

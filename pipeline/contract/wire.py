"""The one encoding of the request contract: every message is a ``msgspec.Struct`` declared once in
``contract/``, and msgspec turns it into msgpack and back.

Why msgspec: a message is declared once, with its types, and the codec follows from the declaration
(a field added to a Struct reaches every stage with no hand-written encoder to update, and a value of
the wrong type is refused at decode, not deep inside a stage); and it encodes Structs directly, with
no intermediate dicts. Each message carries its kind and version (``kind``, ``v``): a
message of another kind or version is refused with a :class:`WireError` that says what arrived,
never half-read.

numpy arrays (image embeddings) travel as a msgpack extension (dtype, shape, raw bytes), never as
pickles.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import numpy as np

_NDARRAY = 1  # msgpack extension code of a numpy array
T = TypeVar("T", bound=msgspec.Struct)


class WireError(ValueError):
    """Bytes that are not the message expected (another kind, another version, or garbage)."""


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return msgspec.msgpack.Ext(_NDARRAY, msgspec.msgpack.encode((arr.dtype.str, arr.shape, arr.data)))
    raise NotImplementedError(f"cannot encode {type(obj).__name__} on the wire")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _NDARRAY:
        raise WireError(f"unknown msgpack extension {code}")
    dtype, shape, raw = msgspec.msgpack.decode(data)
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()  # writable, owns its memory


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"cannot decode {kind!r}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoders: dict[type, msgspec.msgpack.Decoder] = {}
_raw = msgspec.msgpack.Decoder(ext_hook=lambda code, data: None)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, kind: type[T]) -> T:
    """The message of type ``kind`` in ``data``, or a :class:`WireError` naming what arrived instead."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook, ext_hook=_ext_hook)
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        expected = (kind.__struct_config__.tag, _version(kind))
        raise WireError(f"expected a {expected[0]} message version {expected[1]}, got {_what(data)!r} ({exc})") from None


def _version(kind: type) -> int:
    return int(getattr(kind, "VERSION", 0))


def _what(data: bytes) -> Any:
    """(kind, version) of a message, as far as it can be read, for the error that refuses it."""
    try:
        obj = _raw.decode(data)
    except msgspec.DecodeError:
        return "not a msgpack message"
    if isinstance(obj, dict):
        return obj.get("kind"), obj.get("v")
    return type(obj).__name__

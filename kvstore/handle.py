"""KVHandle: the few bytes per block that cross stage boundaries instead of KV tensors.

Declared once, as a ``msgspec.Struct`` like every message of the request contract (it travels inside the
contract's ``Handoff``): the codec follows from the fields, a value of the wrong type is refused at
decode, and a handle of another kind or version is a :class:`HandleError` that says what arrived.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

HANDLE_VERSION = 3  # 3: a declared Struct (2: a hand-packed map, with num_spilled)


class HandleError(ValueError):
    """A handle that cannot be used here (unknown version, other model, malformed bytes)."""


class KVHandle(msgspec.Struct, tag_field="kind", tag="kv_handle"):
    """Where a sequence's KV lives: full blocks by content hash, the partial tail by location.

    ``block_hashes`` covers every full block. The first ``num_spilled`` of them are in a
    lower tier only (pinned there on the holder's behalf); ``block_ids`` locates the rest
    on the device, valid inside the pool named ``pool_id``. A consumer on another pool
    resolves full blocks by hash through the host/disk tiers and recomputes the partial
    tail (fewer than ``block_size`` tokens) itself. ``fingerprint`` names the model, dtype and KV
    layout the blocks were written with (``hashing.model_fingerprint``): nothing else reads them. ``model_key``
    is the same without an FP8 cache's scales: a consumer of the same model whose node calibrated other scales
    cannot read the blocks either, but may recompute the prompt (``same_model_other_scales``).
    """

    VERSION: ClassVar[int] = HANDLE_VERSION

    fingerprint: bytes
    num_tokens: int
    block_hashes: list[bytes]
    block_ids: list[int]
    pool_id: str
    tail_block: int | None = None  # block id of the partial tail (owned by the handle's holder)
    num_spilled: int = 0
    model_key: bytes = b""  # empty from a producer that predates it: a mismatch is then an error
    v: Literal[3] = 3

    def check(self, fingerprint: bytes) -> "KVHandle":
        """This handle, if its blocks were written for the model ``fingerprint`` names."""
        if self.fingerprint != fingerprint:
            raise HandleError("KV handle was made for another model (fingerprint mismatch)")
        return self

    def same_model_other_scales(self, fingerprint: bytes, model_key: bytes) -> bool:
        """Whether the blocks are the consumer's model, dtype and layout, written over other FP8 scales (two nodes
        calibrate each their own): unreadable here, though the prompt is this model's to recompute."""
        return self.fingerprint != fingerprint and bool(self.model_key) and self.model_key == model_key

    def to_bytes(self) -> bytes:
        return _encoder.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes, expected_fingerprint: bytes | None = None) -> "KVHandle":
        try:
            handle = _decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HandleError(f"not a KV handle of version {HANDLE_VERSION} ({_what(data)}): {exc}") from None
        return handle if expected_fingerprint is None else handle.check(expected_fingerprint)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVHandle)
_raw = msgspec.msgpack.Decoder()


def _what(data: bytes) -> str:
    try:
        obj = _raw.decode(data)
    except msgspec.DecodeError:
        return "not msgpack"
    return f"kind {obj.get('kind')!r}, version {obj.get('v')!r}" if isinstance(obj, dict) else type(obj).__name__

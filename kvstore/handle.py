"""KVHandle: the few bytes per block that cross stage boundaries instead of KV tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from strata.kvstore.layout import KVLayout

HANDLE_VERSION = 2  # 2: num_spilled (leading blocks that live only in a lower tier)


class HandleError(ValueError):
    """A handle that cannot be used here (unknown version, other model, malformed bytes)."""


@dataclass
class KVHandle:
    """Where a sequence's KV lives: full blocks by content hash, the partial tail by location.

    ``block_hashes`` covers every full block. The first ``num_spilled`` of them are in a
    lower tier only (pinned there on the holder's behalf); ``block_ids`` locates the rest
    on the device, valid inside the pool named ``pool_id``. A consumer on another pool
    resolves full blocks by hash through the host/disk tiers and recomputes the partial
    tail (fewer than ``block_size`` tokens) itself.
    """

    fingerprint: bytes
    layout: KVLayout
    num_tokens: int
    block_hashes: list[bytes]
    block_ids: list[int]
    pool_id: str
    tail_block: int | None = None  # block id of the partial tail (owned by the handle's holder)
    num_spilled: int = 0
    extra: dict = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            {
                "v": HANDLE_VERSION,
                "fingerprint": self.fingerprint,
                "layout": self.layout.to_dict(),
                "num_tokens": self.num_tokens,
                "block_hashes": self.block_hashes,
                "block_ids": self.block_ids,
                "pool_id": self.pool_id,
                "tail_block": self.tail_block,
                "num_spilled": self.num_spilled,
                "extra": self.extra,
            },
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes, expected_fingerprint: bytes | None = None) -> "KVHandle":
        try:
            obj = msgpack.unpackb(data, raw=False)
        except Exception as exc:
            raise HandleError(f"malformed KV handle: {exc}") from exc
        if not isinstance(obj, dict) or obj.get("v") != HANDLE_VERSION:
            raise HandleError(f"unsupported KV handle version {obj.get('v') if isinstance(obj, dict) else None!r}")
        if expected_fingerprint is not None and obj.get("fingerprint") != expected_fingerprint:
            raise HandleError("KV handle was made for another model (fingerprint mismatch)")
        try:
            return cls._from_obj(obj)
        except (KeyError, TypeError, ValueError) as exc:
            raise HandleError(f"malformed KV handle: {exc!r}") from exc

    @classmethod
    def _from_obj(cls, obj: dict) -> "KVHandle":
        return cls(
            fingerprint=obj["fingerprint"],
            layout=KVLayout.from_dict(obj["layout"]),
            num_tokens=obj["num_tokens"],
            block_hashes=list(obj["block_hashes"]),
            block_ids=list(obj["block_ids"]),
            pool_id=obj["pool_id"],
            tail_block=obj["tail_block"],
            num_spilled=obj["num_spilled"],
            extra=obj.get("extra", {}),
        )

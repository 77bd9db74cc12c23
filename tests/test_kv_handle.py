"""KVHandle wire format (a declared Struct, inside the hand-off): round trip, and clear errors for other versions,
other models, garbage."""

from __future__ import annotations

import msgpack
import pytest

from strata.kvstore import HandleError, KVHandle


def _handle() -> KVHandle:
    return KVHandle(b"fp" * 8, 40, [b"a" * 16, b"b" * 16], [3, 7], "pool-1", tail_block=9)


def test_round_trip_is_small_and_exact() -> None:
    h = _handle()
    data = h.to_bytes()
    assert KVHandle.from_bytes(data, expected_fingerprint=h.fingerprint) == h
    assert len(data) < 200 + 20 * len(h.block_hashes)


def test_fingerprint_mismatch_is_refused() -> None:
    with pytest.raises(HandleError, match="another model"):
        KVHandle.from_bytes(_handle().to_bytes(), expected_fingerprint=b"other-model-----")


def test_unknown_version_and_garbage_are_refused() -> None:
    obj = msgpack.unpackb(_handle().to_bytes(), raw=False)
    obj["v"] = 2
    with pytest.raises(HandleError, match="not a KV handle of version 3 \\(kind 'kv_handle', version 2\\)"):
        KVHandle.from_bytes(msgpack.packb(obj, use_bin_type=True))
    obj["v"], obj["num_tokens"] = 3, "forty"
    with pytest.raises(HandleError, match="Expected `int`, got `str` - at `\\$.num_tokens`"):
        KVHandle.from_bytes(msgpack.packb(obj, use_bin_type=True))
    with pytest.raises(HandleError, match="not msgpack"):
        KVHandle.from_bytes(b"\xc1\xc1 not msgpack")


def test_decoder_refuses_a_handle_from_another_pool(llama_dir) -> None:
    from helpers import build_stages, greedy
    from strata.pipeline.core.sequence import Sequence

    _, decoder = build_stages(llama_dir)
    h = _handle()
    h.fingerprint = decoder.scheduler.fingerprint
    seq = Sequence("x", [5] * 41, greedy(4), 16)
    with pytest.raises(HandleError, match="another block pool"):
        decoder.admit(seq, h)

"""KV hand-off between nodes, in-process: prefill and decode with different host tiers (as on two
nodes), the decode replica pulling the missing full blocks through a block server's read. Blocks
arrive verified or not at all; a block that cannot be fetched is recomputed, never served corrupt.
The same path under a real two-node Ray cluster is in ``test_kv_cross_node.py``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Sequence

import pytest

from helpers import build, greedy
from strata.kvstore import LowerTiers
from strata.kvstore.block_exchange import export_blocks
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.handoff import Handoff
from strata.stages.factory import build_decode_service, build_prefill_service
from strata.stages.kv_transfer import KVPuller

PROMPT = "Tell me the long story of the harbour, the lighthouse and the storm. " * 6


def _node(llama_dir: Path, root: Path, name: str) -> EngineConfig:
    return EngineConfig(host_kv_blocks=512, host_kv_dir=str(root / name))


def _run(llama_dir: Path, tmp_path: Path, fetch_fn) -> tuple[str, dict, dict]:
    prefill = build_prefill_service(llama_dir, _node(llama_dir, tmp_path, "node-a"))
    decode = build_decode_service(llama_dir, _node(llama_dir, tmp_path, "node-b"))
    source_tiers = prefill.prefiller.kv.lower
    if fetch_fn is not None:
        decode.puller = KVPuller(decode.decoder.kv, "node-b", lambda src, hashes: fetch_fn(source_tiers, src, hashes),
                                 run_on_loop=decode.loop.run)
    engine = build(llama_dir)
    request = engine.intake.make_request("r1", greedy(10), prompt=PROMPT)[0]

    async def go() -> str:
        handoff = Handoff.from_msgpack((await prefill.prefill(request)).to_msgpack())
        handoff.source = "node-a"
        text = handoff.first.text_delta
        async for batch in decode.generate(handoff):
            text += "".join(e.text_delta for e in batch)
        return text

    try:
        text = asyncio.run(go())
        stats = asyncio.run(decode.stats())
    finally:
        prefill.close()
        decode.close()
    expected = engine.generate([{"prompt": PROMPT, "params": greedy(10)}])[0].text
    assert text == expected  # whatever happened to the blocks, the answer is the engine's
    return text, stats["handoff_tokens"], stats["kv_transfer_blocks"]


async def _serve(tiers: LowerTiers, _source: str, hashes: Sequence[bytes]) -> list[bytes | None]:
    return export_blocks(tiers, hashes)  # what the source node's block server answers


def test_decode_on_another_node_without_a_pull_recomputes_everything(llama_dir: Path, tmp_path: Path) -> None:
    _, handoff, transfer = _run(llama_dir, tmp_path, None)
    assert handoff.get("recomputed", 0) > 0 and handoff.get("adopted", 0) == 0
    assert transfer == {}


def test_pulled_blocks_are_adopted_not_recomputed(llama_dir: Path, tmp_path: Path) -> None:
    _, handoff, transfer = _run(llama_dir, tmp_path, _serve)
    assert handoff.get("recomputed", 0) == 0 and handoff["adopted"] > 0
    assert transfer["fetched"] >= handoff["adopted"] // 16 and transfer["rejected"] == 0


def test_a_block_corrupted_in_transit_is_rejected_and_recomputed(llama_dir: Path, tmp_path: Path) -> None:
    async def tampered(tiers: LowerTiers, source: str, hashes: Sequence[bytes]) -> list[bytes | None]:
        blobs = await _serve(tiers, source, hashes)
        first = bytearray(blobs[0])
        first[-1] ^= 0xFF  # one flipped bit in the last layer's payload
        return [bytes(first), *blobs[1:]]

    _, handoff, transfer = _run(llama_dir, tmp_path, tampered)
    assert transfer["rejected"] == 1 and transfer["fetched"] >= 1
    assert handoff["recomputed"] > 0  # the block chain is broken at block 0: recompute, never the bad bytes


def test_a_source_node_that_is_gone_costs_a_recompute_not_the_request(llama_dir: Path, tmp_path: Path) -> None:
    async def gone(tiers: LowerTiers, source: str, hashes: Sequence[bytes]) -> list[bytes | None]:
        raise ConnectionError("node-a is unreachable")

    _, handoff, transfer = _run(llama_dir, tmp_path, gone)
    assert transfer["unavailable"] > 0 and transfer.get("fetched", 0) == 0
    assert handoff["recomputed"] > 0


def test_a_block_file_deleted_at_the_source_is_recomputed(llama_dir: Path, tmp_path: Path) -> None:
    async def one_missing(tiers: LowerTiers, source: str, hashes: Sequence[bytes]) -> list[bytes | None]:
        tiers.top.remove(hashes[-1])
        return await _serve(tiers, source, hashes)

    _, handoff, transfer = _run(llama_dir, tmp_path, one_missing)
    assert transfer["unavailable"] == 1
    assert handoff["recomputed"] > 0


@pytest.mark.parametrize("damage", ["payload", "hash"])
def test_verify_blob_refuses_damage(llama_dir: Path, tmp_path: Path, damage: str) -> None:
    from strata.kvstore.block_file import BlockFileError, verify_blob

    prefill = build_prefill_service(llama_dir, _node(llama_dir, tmp_path, "a"))
    try:
        kv = prefill.prefiller.kv
        engine = build(llama_dir)
        request = engine.intake.make_request("r", greedy(5), prompt=PROMPT)[0]
        handoff = asyncio.run(prefill.prefill(request))
        h = handoff.kv_handle.block_hashes[0]
        blob = export_blocks(kv.lower, [h])[0]
        verify_blob(blob, h, kv.fingerprint, kv.layout)  # intact: accepted
        with pytest.raises(BlockFileError):
            if damage == "payload":
                verify_blob(blob[:-1] + bytes([blob[-1] ^ 1]), h, kv.fingerprint, kv.layout)
            else:
                verify_blob(blob, b"\0" * len(h), kv.fingerprint, kv.layout)
    finally:
        prefill.close()

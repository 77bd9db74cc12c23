"""One KV block server per node (a Ray actor), so a decode replica on another node can pull the
blocks a prefill left in this node's host tier (``stages.kv_transfer``).

The server opens the node's host/disk tiers with the model's fingerprint and layout, and answers
``read(hashes)`` with whole verified block files (None for a block it does not have or finds
corrupt). The receiver verifies every file again before storing it. Servers are named by model
fingerprint and node, created on first use by a prefill replica on that node (detached: they live
as long as the cluster, whichever replica started them).
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from strata.kvstore import KVLayout, LowerTiers, TieredKVCache
from strata.kvstore.block_exchange import export_blocks

NAMESPACE = "strata-kv"


def server_name(fingerprint: bytes, node_id: str) -> str:
    return f"blocks-{fingerprint.hex()[:16]}-{node_id[:24]}"


@ray.remote(num_cpus=0)
class BlockServer:
    def __init__(self, layout: dict[str, Any], fingerprint: bytes, tiers: dict[str, Any]) -> None:
        lower = LowerTiers.open(KVLayout.from_dict(layout), fingerprint, **tiers)
        if lower is None:
            raise ValueError("a block server needs a host or disk tier")
        self.lower = lower

    def read(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        return export_blocks(self.lower, list(hashes))

    def ready(self) -> bool:
        return True


def _tier_args(kv: TieredKVCache) -> dict[str, Any]:
    assert kv.lower is not None
    args: dict[str, Any] = {}
    for tier in kv.lower.tiers:
        args[f"{tier.name}_dir"] = str(tier.root)
        args[f"{tier.name}_blocks"] = tier.capacity
    return args


def ensure_block_server(kv: TieredKVCache) -> str:
    """Start this node's block server for the model if none runs yet; returns this node's id."""
    node = ray.get_runtime_context().get_node_id()
    BlockServer.options(
        name=server_name(kv.fingerprint, node), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(kv.layout.to_dict(), kv.fingerprint, _tier_args(kv))
    return node


def block_fetcher(fingerprint: bytes, timeout_s: float = 30.0):
    """``fetch(source_node, hashes)`` for :class:`stages.kv_transfer.KVPuller`: the source node's server.
    A server that does not answer within ``timeout_s`` costs a recompute, never a stuck request."""
    async def fetch(source: str, hashes: Sequence[bytes]) -> list[bytes | None]:
        try:
            server = ray.get_actor(server_name(fingerprint, source), namespace=NAMESPACE)
        except ValueError:  # no server on that node (gone, or never started): every block is recomputed
            return [None] * len(hashes)
        return await asyncio.wait_for(server.read.remote(list(hashes)), timeout=timeout_s)

    return fetch

"""KV hand-off between nodes: a decode replica pulls the full blocks a prefill on another node left
in that node's host tier, before it adopts the hand-off.

The host tier is per node (block files on ``/dev/shm``), so a decode replica on another node finds
none of the prefill's blocks there. :class:`KVPuller` asks the source node's block server (any
callable that maps hashes to whole block files, so this module needs no Ray) for the blocks missing
here, verifies every file (block hash, model fingerprint, layout, per-layer checksums) and stores
the good ones in the local host tier. A block that cannot be fetched, or arrives corrupt, is not
stored: the decoder then recomputes it, as it would any missing block, and the count says so.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Awaitable, Callable, Sequence

from strata.kvstore import TieredKVCache
from strata.kvstore.block_exchange import import_blocks, missing_blocks
from strata.pipeline.contract.handoff import Handoff

log = logging.getLogger("strata.kv_transfer")
Fetch = Callable[[str, Sequence[bytes]], Awaitable[list[bytes | None]]]


class KVPuller:
    def __init__(self, kv: TieredKVCache, node_id: str, fetch: Fetch, run_on_loop: Callable | None = None) -> None:
        """``fetch(source_node, hashes)`` returns each block's file (None where the source has none);
        ``run_on_loop(fn)`` (awaitable) runs tier writes on the stage's loop thread."""
        if kv.lower is None:
            raise ValueError("pulling KV from another node needs a host or disk tier here")
        self.kv, self.node_id, self.fetch, self.run_on_loop = kv, node_id, fetch, run_on_loop
        self.lower = kv.lower
        self.counts: Counter[str] = Counter()  # fetched / rejected / unavailable blocks

    def needs_pull(self, handoff: Handoff) -> bool:
        return bool(handoff.source) and handoff.source != self.node_id

    async def pull(self, handoff: Handoff) -> int:
        """Bring the hand-off's missing full blocks here; returns how many were stored."""
        if handoff.kv_handle is None:  # the request finished at prefill: nothing to bring
            return 0
        if handoff.kv_handle.same_model_other_scales(self.kv.fingerprint, self.kv.model_key):
            return 0  # blocks over another node's FP8 scales: unreadable here, the decoder recomputes
        handle = handoff.kv_handle.check(self.kv.fingerprint)
        full = handle.block_hashes[: handle.num_tokens // self.kv.layout.block_size]
        missing = await self._on_loop(lambda: missing_blocks(self.lower, full))
        if not missing:
            return 0
        try:
            blobs = await self.fetch(handoff.source, missing)
        except Exception as exc:  # the source node or its server is gone: recompute, never fail the request
            log.warning("request %s: fetching %d KV blocks from another node failed: %r", handoff.request_id,
                        len(missing), exc)
            blobs = [None] * len(missing)
        stored, rejected = await self._on_loop(
            lambda: import_blocks(self.lower, list(zip(missing, blobs)), self.kv.fingerprint))
        unavailable = sum(b is None for b in blobs)
        self.counts.update(fetched=stored, rejected=rejected, unavailable=unavailable)
        if rejected or unavailable:
            log.info("request %s: %d KV blocks rejected, %d unavailable from the source node; they are recomputed",
                     handoff.request_id, rejected, unavailable)
        return stored

    async def _on_loop(self, fn):
        if self.run_on_loop is None:
            return fn()
        return await self.run_on_loop(fn)

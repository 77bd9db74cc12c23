"""Two Ray nodes on loopback, a prefill actor on one and a decode actor on the other, each node with
its own host tier: what `strata bench cross-node` (and its test) measure the KV hand-off between
nodes with. The actors run the same stage services and the same block server and puller as the
Serve deployments (``kv_blocks``, ``stages.kv_transfer``).
"""

from __future__ import annotations

import os
import time
from typing import Any


class TwoNodeHandoff:
    def __init__(self, model_dir: str, root: str) -> None:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback node addresses (read when ray is imported)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        import ray
        from ray.cluster_utils import Cluster

        self._ray = ray
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                                     "include_dashboard": False})
        try:
            self.cluster.add_node(num_cpus=1, resources={"node_b": 1})
            ray.init(address=self.cluster.address, logging_level="ERROR")
            prefill_cls, decode_cls = _actors(model_dir, root)
            self._prefill, self._decode = prefill_cls.remote(), decode_cls.remote()
        except BaseException:
            self.close()
            raise

    def prefill(self, request: bytes) -> bytes:
        """A msgpack ``Request`` prefilled on node A; its ``Handoff`` (naming node A as the source)."""
        return self._ray.get(self._prefill.prefill.remote(request))

    def damage(self, handoff: bytes) -> None:
        """Delete one of the hand-off's block files on node A and corrupt another."""
        self._ray.get(self._prefill.damage.remote(handoff))

    def decode(self, handoff: bytes, pull: bool) -> dict[str, Any]:
        """Decode on node B, pulling the blocks from node A or not; text, timing and this request's counts."""
        return self._ray.get(self._decode.generate.remote(handoff, pull))

    def close(self) -> None:
        self._ray.shutdown()
        self.cluster.shutdown()


def _actors(model: str, root: str):
    """The two node actors (defined here: ``ray`` is imported only once the environment is set)."""
    import ray

    from strata.deployments.ray_serve.kv_blocks import block_fetcher, ensure_block_server
    from strata.pipeline.contract.config import EngineConfig
    from strata.pipeline.contract.handoff import Handoff
    from strata.pipeline.contract.request import Request
    from strata.stages.factory import build_decode_service, build_prefill_service
    from strata.stages.kv_transfer import KVPuller

    def config(name: str) -> EngineConfig:
        return EngineConfig(host_kv_blocks=8192, host_kv_dir=os.path.join(root, name), max_model_len=16384)

    @ray.remote(num_cpus=0, resources={"node_a": 0.01})
    class PrefillNode:
        def __init__(self) -> None:
            self.service = build_prefill_service(model, config("node-a"))
            self.node = ensure_block_server(self.service.prefiller.kv)

        async def prefill(self, data: bytes) -> bytes:
            handoff = await self.service.prefill(Request.from_msgpack(data))
            handoff.source = self.node
            return handoff.to_msgpack()

        def damage(self, data: bytes) -> None:
            """Delete one of the hand-off's block files and corrupt another, on this node only."""
            handle = Handoff.from_msgpack(data).kv_handle
            assert handle is not None, "the bench's prompts outlast their first token"
            hashes = handle.block_hashes
            store = self.service.prefiller.kv.lower.top
            os.unlink(store.files.path(hashes[1]))
            with open(store.files.path(hashes[2]), "r+b") as f:
                f.seek(-8, 2)
                f.write(b"\xff" * 8)

    @ray.remote(num_cpus=0, resources={"node_b": 0.01})
    class DecodeNode:
        def __init__(self) -> None:
            self.service = build_decode_service(model, config("node-b"))
            kv = self.service.decoder.kv
            self.node = ray.get_runtime_context().get_node_id()
            self.puller = KVPuller(kv, self.node, block_fetcher(kv.fingerprint), run_on_loop=self.service.loop.run)

        async def generate(self, data: bytes, pull: bool) -> dict[str, Any]:
            """Decode one hand-off; what this request moved and recomputed (not running totals)."""
            self.service.puller = self.puller if pull else None
            handoff = Handoff.from_msgpack(data)
            moved, handed = dict(self.puller.counts), dict(self.service.decoder.handoff_tokens)
            text, t0, first = handoff.first.text_delta, time.perf_counter(), None
            async for batch in self.service.generate(handoff):
                first = first if first is not None else time.perf_counter() - t0
                text += "".join(e.text_delta for e in batch)
            delta = lambda now, then: {k: v - then.get(k, 0) for k, v in now.items()}  # noqa: E731
            return {"text": text, "node": self.node, "source": handoff.source, "first_token_s": first,
                    "transfer": delta(self.puller.counts, moved),
                    "handoff_tokens": delta(self.service.decoder.handoff_tokens, handed)}

    return PrefillNode, DecodeNode

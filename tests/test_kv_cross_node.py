"""KV hand-off across a real two-node Ray cluster on loopback (``ray.cluster_utils.Cluster``): prefill
on node A, decode on node B, each node with its own host tier. Full blocks move through node A's
block server and are not recomputed; a block deleted or corrupted on node A is recomputed on B,
never served. Runs in a child process so that the cluster gets loopback addresses from the start."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from helpers import run_python

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster
    from strata.deployments.kv_blocks import block_fetcher, ensure_block_server
    from strata.pipeline.config import EngineConfig
    from strata.pipeline.handoff import Handoff
    from strata.pipeline.request import Request
    from strata.pipeline.sampling_params import SamplingParams
    from strata.stages.factory import build_decode_service, build_engine, build_prefill_service
    from strata.stages.kv_transfer import KVPuller

    model, root = sys.argv[1], sys.argv[2]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    ray.init(address=cluster.address)

    def config(name):
        return EngineConfig(host_kv_blocks=512, host_kv_dir=os.path.join(root, name))

    @ray.remote(num_cpus=0, resources={"node_a": 0.01})
    class PrefillNode:
        def __init__(self):
            self.service = build_prefill_service(model, config("node-a"))
            self.node = ensure_block_server(self.service.prefiller.kv)

        async def prefill(self, data):
            handoff = await self.service.prefill(Request.from_msgpack(data))
            handoff.source = self.node
            return handoff.to_msgpack()

        def damage(self, data):
            # delete one of the request's block files and corrupt another, on this node only
            from strata.kvstore import KVHandle
            hashes = KVHandle.from_bytes(Handoff.from_msgpack(data).kv_handle).block_hashes
            store = self.service.prefiller.kv.lower.top
            os.unlink(store.path(hashes[1]))
            with open(store.path(hashes[2]), "r+b") as f:
                f.seek(-8, 2)
                f.write(b"\\xff" * 8)

    @ray.remote(num_cpus=0, resources={"node_b": 0.01})
    class DecodeNode:
        def __init__(self):
            self.service = build_decode_service(model, config("node-b"))
            kv = self.service.decoder.kv
            self.node = ray.get_runtime_context().get_node_id()
            self.service.puller = KVPuller(kv, self.node, block_fetcher(kv.fingerprint), run_on_loop=self.service.loop.run)

        async def generate(self, data):
            handoff = Handoff.from_msgpack(data)
            text = handoff.first.text_delta
            async for batch in self.service.generate(handoff):
                text += "".join(e.text_delta for e in batch)
            stats = await self.service.stats()
            return {"text": text, "node": self.node, "handoff": stats["handoff_tokens"],
                    "transfer": stats["kv_transfer_blocks"]}

    engine = build_engine(model, EngineConfig())
    params = SamplingParams(max_tokens=10, temperature=0.0)
    prompts = ["The long story of the harbour and the lighthouse, told slowly. " * 6,
               "Another tale of ships, storms and the keepers of the light. " * 6]
    expected = [o.text for o in engine.generate([{"prompt": p, "params": params} for p in prompts])]
    prefill, decode = PrefillNode.remote(), DecodeNode.remote()
    results = []
    for i, prompt in enumerate(prompts):
        request = engine.intake.make_request(f"r{i}", SamplingParams(max_tokens=10, temperature=0.0), prompt=prompt)[0]
        handoff = ray.get(prefill.prefill.remote(request.to_msgpack()))
        if i == 1:
            ray.get(prefill.damage.remote(handoff))
        out = ray.get(decode.generate.remote(handoff))
        out["source"] = Handoff.from_msgpack(handoff).source
        out["expected"] = expected[i]
        out["blocks"] = (len(Handoff.from_msgpack(handoff).token_ids) - 1) // 16
        results.append(out)
    print("RESULT " + json.dumps(results))
    ray.shutdown()
    cluster.shutdown()
    """
)


def test_prefill_on_one_node_decode_on_another(llama_dir: Path, tmp_path: Path) -> None:
    res = run_python("-c", _SCRIPT, str(llama_dir), str(tmp_path), timeout=600)
    line = next((l for l in res.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, res.stderr[-4000:]
    clean, damaged = json.loads(line[len("RESULT "):])
    assert clean["source"] != clean["node"], "prefill and decode must run on different nodes"
    # clean: every full block crossed over, nothing recomputed, the engine's answer
    assert clean["text"] == clean["expected"]
    assert clean["transfer"]["fetched"] == clean["blocks"] and clean["handoff"].get("recomputed", 0) == 0
    # damaged on node A: the deleted and the corrupt block are not served; B recomputes, same answer
    assert damaged["text"] == damaged["expected"]
    transfer = damaged["transfer"]
    assert transfer["unavailable"] - clean["transfer"].get("unavailable", 0) == 2
    assert damaged["handoff"]["recomputed"] > 0

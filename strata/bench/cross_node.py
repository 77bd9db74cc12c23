"""`strata bench cross-node`: the prefill->decode hand-off between two Ray nodes, against recomputing.

Starts a two-node Ray cluster on loopback (``ray.cluster_utils.Cluster``), each node with its own
host tier. A prefill actor on node A prefills; a decode actor on node B either pulls the full
blocks from node A's block server (``stages.kv_transfer``) or, with the pull off, recomputes them.
Both sides time the decode replica from receiving the hand-off to its first decoded token, on
different prompts of the same length (so neither finds the other's blocks). Each answer is checked
against the in-process engine. A last request has one block file deleted and one corrupted on node
A: both must be recomputed on B, never served, and the answer must not change.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="checkpoint (default: the tiny demo model)")
    p.add_argument("--prompt-tokens", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--json", type=Path)


def _actors(model: str, root: str):
    """The two node actors (defined here: ``ray`` is imported only once the environment is set)."""
    import ray

    from strata.deployments.kv_blocks import block_fetcher, ensure_block_server
    from strata.pipeline.config import EngineConfig
    from strata.pipeline.handoff import Handoff
    from strata.pipeline.request import Request
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
            from strata.kvstore import KVHandle

            hashes = KVHandle.from_bytes(Handoff.from_msgpack(data).kv_handle).block_hashes
            store = self.service.prefiller.kv.lower.top
            os.unlink(store.path(hashes[1]))
            with open(store.path(hashes[2]), "r+b") as f:
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


def run(args: argparse.Namespace) -> int:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback node addresses (read when ray is imported)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    from strata.pipeline.config import EngineConfig
    from strata.pipeline.sampling_params import SamplingParams
    from strata.pipeline.tiny_model import ensure_demo_model
    from strata.stages.factory import build_engine

    model = args.model or ensure_demo_model()
    engine = build_engine(model, EngineConfig(max_model_len=16384))
    vocab = engine.model_config.text.vocab_size
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)

    special = {engine.model_config.image_token_id, *engine.model_config.eos_token_ids}

    def request(rid: str, n: int):
        ids = [t for t in (rng.randrange(3, vocab) for _ in range(2 * n)) if t not in special][:n]
        return engine.intake.make_request(rid, SamplingParams(**vars(params)), prompt_token_ids=ids)[0], ids

    def expected(ids: list[int]) -> str:
        return engine.generate([{"prompt_token_ids": ids, "params": SamplingParams(**vars(params))}])[0].text

    print(f"# strata bench cross-node: {model.name}, prefill on node A, decode on node B (two Ray nodes on loopback, "
          f"own host tiers); time from hand-off to first decoded token on B: blocks pulled from A vs recomputed on B",
          flush=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                            "include_dashboard": False})
    results: dict[str, Any] = {"rows": []}
    try:
        cluster.add_node(num_cpus=1, resources={"node_b": 1})
        ray.init(address=cluster.address, logging_level="ERROR")
        prefill_cls, decode_cls = _actors(str(model), tempfile.mkdtemp(prefix="strata-cross-node-"))
        prefill, decode = prefill_cls.remote(), decode_cls.remote()
        warm, _ = request("warm", 64)
        ray.get(decode.generate.remote(ray.get(prefill.prefill.remote(warm.to_msgpack())), True))
        print(f"{'tokens':>7} {'blocks':>6} {'pull ms':>9} {'per block':>10} {'recompute ms':>13} {'per block':>10} "
              f"{'ratio':>6}", flush=True)
        ok = True
        for n in args.prompt_tokens:
            row: dict[str, Any] = {"prompt_tokens": n, "blocks": n // 16}
            for mode, pull in (("pull", True), ("recompute", False)):
                req, ids = request(f"{mode}-{n}", n)
                out = ray.get(decode.generate.remote(ray.get(prefill.prefill.remote(req.to_msgpack())), pull))
                row[f"{mode}_s"] = out["first_token_s"]
                row[f"{mode}_correct"] = out["text"] == expected(ids)
                row[f"{mode}_transfer"], row[f"{mode}_handoff_tokens"] = out["transfer"], out["handoff_tokens"]
                row["crossed_nodes"] = out["source"] != out["node"]
                ok &= row[f"{mode}_correct"] and row["crossed_nodes"]
            results["rows"].append(row)
            b = row["blocks"]
            print(f"{n:>7} {b:>6} {row['pull_s'] * 1e3:9.1f} {row['pull_s'] * 1e3 / b:8.2f} ms "
                  f"{row['recompute_s'] * 1e3:11.1f} {row['recompute_s'] * 1e3 / b:8.2f} ms "
                  f"{row['recompute_s'] / row['pull_s']:5.1f}x", flush=True)
        req, ids = request("damaged", args.prompt_tokens[0])
        handoff = ray.get(prefill.prefill.remote(req.to_msgpack()))
        ray.get(prefill.damage.remote(handoff))
        out = ray.get(decode.generate.remote(handoff, True))
        damaged = {"correct": out["text"] == expected(ids), "unavailable": out["transfer"].get("unavailable", 0),
                   "recomputed_tokens": out["handoff_tokens"].get("recomputed", 0)}
        results["damaged"] = damaged
        ok &= damaged["correct"] and damaged["unavailable"] == 2
        print(f"# a deleted and a corrupted block on node A: {damaged['unavailable']} blocks refused at the source, "
              f"{damaged['recomputed_tokens']} tokens recomputed on B, answer "
              f"{'unchanged' if damaged['correct'] else 'CHANGED'}")
        print(f"# answers equal the in-process engine's: {'yes' if ok else 'NO'}")
    finally:
        ray.shutdown()
        cluster.shutdown()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if ok else 1

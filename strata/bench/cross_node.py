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
import random
import tempfile
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="checkpoint (default: the tiny demo model)")
    p.add_argument("--prompt-tokens", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--json", type=Path)


def run(args: argparse.Namespace) -> int:
    from strata.deployments.ray_serve.two_node import TwoNodeHandoff
    from strata.pipeline.contract.config import EngineConfig
    from strata.pipeline.contract.sampling_params import SamplingParams
    from strata.stages.factory import build_engine
    from strata.checkpoints.tiny_model import ensure_demo_model

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
    results: dict[str, Any] = {"rows": []}
    nodes = TwoNodeHandoff(str(model), tempfile.mkdtemp(prefix="strata-cross-node-"))
    try:
        warm, _ = request("warm", 64)
        nodes.decode(nodes.prefill(warm.to_msgpack()), pull=True)
        print(f"{'tokens':>7} {'blocks':>6} {'pull ms':>9} {'per block':>10} {'recompute ms':>13} {'per block':>10} "
              f"{'ratio':>6}", flush=True)
        ok = True
        for n in args.prompt_tokens:
            row: dict[str, Any] = {"prompt_tokens": n, "blocks": n // 16}
            for mode, pull in (("pull", True), ("recompute", False)):
                req, ids = request(f"{mode}-{n}", n)
                out = nodes.decode(nodes.prefill(req.to_msgpack()), pull=pull)
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
        handoff = nodes.prefill(req.to_msgpack())
        nodes.damage(handoff)
        out = nodes.decode(handoff, pull=True)
        damaged = {"correct": out["text"] == expected(ids), "unavailable": out["transfer"].get("unavailable", 0),
                   "recomputed_tokens": out["handoff_tokens"].get("recomputed", 0)}
        results["damaged"] = damaged
        ok &= damaged["correct"] and damaged["unavailable"] == 2
        print(f"# a deleted and a corrupted block on node A: {damaged['unavailable']} blocks refused at the source, "
              f"{damaged['recomputed_tokens']} tokens recomputed on B, answer "
              f"{'unchanged' if damaged['correct'] else 'CHANGED'}")
        print(f"# answers equal the in-process engine's: {'yes' if ok else 'NO'}")
    finally:
        nodes.close()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if ok else 1

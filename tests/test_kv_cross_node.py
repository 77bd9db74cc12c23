"""KV hand-off across a real two-node Ray cluster on loopback (``ray.cluster_utils.Cluster``), through
`strata bench cross-node`: prefill on node A, decode on node B, each node with its own host tier.
Full blocks move through node A's block server and are not recomputed; a block deleted or corrupted
on node A is recomputed on B, never served. A child process, so the cluster gets loopback
addresses from the start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_strata

pytestmark = pytest.mark.slow


def test_prefill_on_one_node_decode_on_another(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cross-node.json"
    res = run_strata("bench", "cross-node", "--model", str(llama_dir), "--prompt-tokens", "256",
                     "--json", str(out), timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["crossed_nodes"], "prefill and decode must run on different nodes"
    assert row["pull_correct"] and row["recompute_correct"]  # the engine's answer either way
    # the pulled request: every full block crossed over and none was recomputed
    assert row["pull_transfer"] == {"fetched": row["blocks"], "rejected": 0, "unavailable": 0}
    assert row["pull_handoff_tokens"] == {"adopted": 256, "recomputed": 0}
    # without the pull, node B has none of the blocks: the whole prompt is recomputed
    assert not any(row["recompute_transfer"].values())
    assert row["recompute_handoff_tokens"] == {"adopted": 0, "recomputed": 256}
    # damaged on node A: the deleted and the corrupt block are refused at the source and recomputed on B
    assert result["damaged"] == {"correct": True, "unavailable": 2, "recomputed_tokens": 256}

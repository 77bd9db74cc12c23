"""The serve config maps onto Serve deployment options: bounds, backpressure, the stage's own policy."""

from __future__ import annotations

import json
import os

import pytest

from strata.deployments.ray_serve.app import deployment_options
from strata.deployments.ray_serve.config import SIGNALS, STAGES, ServeConfig


def test_every_stage_gets_its_own_policy_and_bounded_queues() -> None:
    config = ServeConfig.from_dict({"stages": {"prefill": {"max_replicas": 3, "target_per_replica": 1000,
                                                           "max_queued_requests": 64, "retry_after_s": 2.5}}})
    for stage in STAGES:
        opts = deployment_options(config, stage)
        policy = opts["autoscaling_config"].policy
        assert policy.policy_kwargs["signal"] == SIGNALS[stage] and policy.policy_kwargs["stage"] == stage
        assert opts["backpressure_config"].status_code == 429
        assert opts["max_queued_requests"] > 0  # never an unbounded queue
    prefill = deployment_options(config, "prefill")
    assert prefill["autoscaling_config"].max_replicas == 3
    assert prefill["autoscaling_config"].policy.policy_kwargs["target"] == 1000
    assert prefill["max_queued_requests"] == 64 and prefill["backpressure_config"].retry_after_s == 2.5
    assert deployment_options(config, "decode")["autoscaling_config"].policy.policy_kwargs["occupancy_target"] == 0.85


def test_the_policy_scales_on_the_stage_signal() -> None:
    from types import SimpleNamespace

    from strata.deployments.ray_serve.autoscaling import StageSignalPolicy

    policy = StageSignalPolicy("queued_prompt_tokens", 1000.0, stage="prefill")
    ctx = lambda metrics, current=1: SimpleNamespace(  # noqa: E731
        aggregated_metrics=metrics, target_num_replicas=current, current_num_replicas=current,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4)
    assert policy(ctx({"queued_prompt_tokens": {"r1": 2500.0, "r2": 600.0}}))[0] == 4  # ceil(3100 / 1000)
    assert policy(ctx({"queued_prompt_tokens": {"r1": 0.0}}, current=3))[0] == 1  # idle: back to the minimum
    assert policy(ctx({}, current=2))[0] == 2  # no reports yet: hold steady
    assert policy(ctx({"queued_prompt_tokens": {"r1": 9e9}}))[0] == 4  # clamped to the maximum
    decode = StageSignalPolicy("running_sequences", 32.0, occupancy_target=0.8, stage="decode")
    assert decode(ctx({"running_sequences": {"r1": 4.0}, "kv_occupancy": {"r1": 0.95}}, current=2))[0] == 3


@pytest.mark.parametrize("bad", [{"max_queued_requests": 0}, {"retry_after_s": -1}])
def test_bad_queue_bounds_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match="stages.ingress"):
        ServeConfig.from_dict({"stages": {"ingress": bad}})


def test_a_tensor_parallel_stage_reserves_one_bundle_per_rank_and_tells_its_engine() -> None:
    from strata.deployments.ray_serve.app import engine_for

    config = ServeConfig.from_dict({"mode": "disaggregated", "engine": {"tp": 1},
                                    "stages": {"decode": {"tp": 2, "num_cpus": 1}}})
    decode = deployment_options(config, "decode")
    assert decode["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 1}]
    assert decode["ray_actor_options"]["num_cpus"] == 1  # the replica (rank 0) fits the first bundle
    assert engine_for(config, "decode")["tp"] == 2 and engine_for(config, "prefill")["tp"] == 1
    assert "placement_group_bundles" not in deployment_options(config, "prefill")
    everywhere = ServeConfig.from_dict({"engine": {"tp": 2}})  # the engine's tp: every decoder stage
    assert len(deployment_options(everywhere, "llm")["placement_group_bundles"]) == 2
    assert engine_for(everywhere, "encode")["tp"] == 1  # the encoder never splits
    with pytest.raises(ValueError, match="only prefill, decode, llm run the decoder"):
        ServeConfig.from_dict({"stages": {"preprocess": {"tp": 2}}})


def test_the_published_config_schema_is_the_codes() -> None:
    """docs/config.schema.json is generated from the models; a config change regenerates it
    (`python -m strata.deployments.ray_serve.config > docs/config.schema.json`)."""
    import json

    from helpers import REPO
    from strata.deployments.ray_serve.config import config_schema

    assert json.loads((REPO / "docs" / "config.schema.json").read_text()) == config_schema()
    engine = config_schema()["$defs"]["EngineConfig"]
    assert engine["additionalProperties"] is False and "num_kv_blocks" in engine["properties"]


@pytest.mark.parametrize("config, message", [
    ({"engine": {"prefil_chunk_tokens": 64}}, "unknown config key engine.prefil_chunk_tokens"),
    ({"stages": {"decode": {"max_replicas": "2"}}}, "stages.decode.max_replicas: Input should be a valid integer"),
    ({"engine": {"compile": 1}}, "engine.compile: Input should be a valid boolean"),
])
def test_a_misspelled_or_mistyped_key_is_one_line_naming_its_path(config: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        ServeConfig.from_dict(config)
    assert str(err.value) == message


def test_a_replica_that_reserves_no_cpus_still_computes_on_every_core() -> None:
    """Ray starts such a replica with OMP_NUM_THREADS=1; the engine's thread budget overrides it (the
    cores of the process's affinity mask, split among tp ranks), a reserved count wins, and closing
    an engine puts the process's own setting back."""
    from helpers import run_python

    script = (
        "import json, os, torch\n"
        "from strata.kernels.threads import apply_threads\n"
        "out = {'start': torch.get_num_threads()}\n"
        "undo = apply_threads(); out['auto'] = torch.get_num_threads(); undo()\n"
        "out['undone'] = [torch.get_num_threads(), os.environ['OMP_NUM_THREADS']]\n"
        "apply_threads(tp=2); out['tp2'] = [torch.get_num_threads(), os.environ['OMP_NUM_THREADS']]\n"
        "apply_threads(num_threads=3); out['reserved'] = torch.get_num_threads()\n"
        "print(json.dumps(out))\n"
    )
    proc = run_python("-c", script, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    cores = len(os.sched_getaffinity(0))
    assert out["start"] == 1 and out["auto"] == cores and out["undone"] == [1, "1"]
    assert out["tp2"] == [max(1, cores // 2), str(max(1, cores // 2))] and out["reserved"] == 3

"""Builds the one Serve application from one config, in the configured mode.

aggregated:     Preprocess, Encode, and LLM (the HTTP ingress, running prefill and decode over one pool)
disaggregated:  Preprocess, Encode, Prefill, Decode, behind the Ingress
(A text-only model has no Preprocess and Encode: its requests never need them.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, BackpressureConfig

from strata.deployments.ray_serve.autoscaling import StageSignalPolicy
from strata.deployments.ray_serve.config import SIGNALS, ServeConfig
from strata.deployments.ray_serve.ingress import Ingress
from strata.deployments.ray_serve.stage_deployments import Decode, Encode, Prefill, Preprocess
from strata.pipeline.models.model_config import load_model_config


def resolve_model(config: ServeConfig) -> ServeConfig:
    """Make the model directory absolute, fill in its name, and an absolute host-tier directory every
    replica on the node shares. (The entry room picks the demo model when none is given.)"""
    if config.model_dir is None:
        raise ValueError("no model: give --model or \"model_dir\" in the config")
    config.model_dir = str(Path(config.model_dir).resolve())
    config.model_name = config.model_name or Path(config.model_dir).name
    engine = config.engine
    engine.host_kv_dir = str(engine.resolved_host_kv_dir()) if engine.host_kv_blocks else engine.host_kv_dir
    engine.disk_kv_dir = str(engine.resolved_disk_kv_dir()) if engine.disk_kv_blocks else engine.disk_kv_dir
    return config


MIN_BUNDLE_CPUS = 0.01  # a placement-group bundle needs some resource; "no CPU limit" reserves next to nothing
# Serve counts an HTTP request against a replica while its body is still arriving; the ingress admits it
# (our 429 limit) only once the body is whole. These extra Serve slots let that many stalled uploads sit
# out their body deadline (408) without holding up clients whose requests did arrive.
STALLED_UPLOAD_SLOTS = 256


def deployment_options(config: ServeConfig, stage: str, access_log: bool = False) -> dict[str, Any]:
    """Replica resources and the stage's own autoscaling policy, from its section of the config. The
    HTTP-facing deployment admits requests itself (a JSON 429 with Retry-After past its limit), so
    Serve's own limits sit above that."""
    sc = config.stages[stage]
    policy = AutoscalingPolicy(
        policy_function=StageSignalPolicy,
        policy_kwargs={
            "signal": SIGNALS[stage],
            "target": config.target(stage),
            "occupancy_target": sc.kv_occupancy_target if stage in ("decode", "llm") else None,
            "stage": stage,
        },
    )
    autoscaling = AutoscalingConfig(
        min_replicas=sc.min_replicas, max_replicas=sc.max_replicas, initial_replicas=sc.initial_replicas,
        upscale_delay_s=sc.upscale_delay_s, downscale_delay_s=sc.downscale_delay_s,
        metrics_interval_s=sc.metrics_interval_s, look_back_period_s=sc.look_back_period_s, policy=policy,
    )
    http_facing = stage in ("ingress", "llm")
    tp = config.tp(stage)
    group = {}
    if tp > 1:  # one bundle per rank; the replica (rank 0) takes the first, its workers the others
        cpus = sc.num_cpus or MIN_BUNDLE_CPUS
        group = {"placement_group_bundles": [{"CPU": cpus}] * tp, "placement_group_strategy": "PACK"}
    return {
        **group,
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": (sc.max_ongoing_requests + sc.max_queued_requests + STALLED_UPLOAD_SLOTS if http_facing
                                 else sc.max_ongoing_requests),
        "max_queued_requests": 64 if http_facing else sc.max_queued_requests,
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=sc.retry_after_s),
        "ray_actor_options": {"num_cpus": sc.num_cpus or (MIN_BUNDLE_CPUS if tp > 1 else 0.0)},
        "logging_config": {"enable_access_log": access_log},
    }


def engine_for(config: ServeConfig, stage: str) -> dict[str, Any]:
    """The engine config of one stage's replicas. A replica that reserves CPUs (``num_cpus``) runs torch
    on that many threads, so replicas packed onto a node do not each run a full set; one that reserves
    none (the default) runs on every core of its node (``kernels.threads.apply_threads``)."""
    engine = config.engine.to_dict()
    engine["tp"] = config.tp(stage)
    cpus = config.stages[stage].num_cpus
    if cpus >= 1 and not engine.get("num_threads"):
        engine["num_threads"] = int(cpus)
    return engine


def build_app(config: ServeConfig, access_log: bool = False) -> serve.Application:
    config = resolve_model(config)
    model = config.model_dir

    def options(stage: str) -> dict[str, Any]:
        return deployment_options(config, stage, access_log)

    preprocess, encode = None, None
    if load_model_config(model).takes_images:  # a text-only LLM has no image stages to deploy
        preprocess = Preprocess.options(name="Preprocess", **options("preprocess")).bind(model, engine_for(config, "preprocess"))
        encode = Encode.options(name="Encode", **options("encode")).bind(model, engine_for(config, "encode"))
    if config.mode == "aggregated":
        llm_config = config.to_dict()
        llm_config["engine"] = engine_for(config, "llm")
        return Ingress.options(name="LLM", **options("llm")).bind(preprocess, encode, None, None, llm_config)
    prefill = Prefill.options(**options("prefill")).bind(model, engine_for(config, "prefill"))
    decode = Decode.options(**options("decode")).bind(model, engine_for(config, "decode"))
    return Ingress.options(**options("ingress")).bind(preprocess, encode, prefill, decode, config.to_dict())

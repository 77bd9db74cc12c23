"""Builds the one Serve application from one config: four stages behind the ingress."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, BackpressureConfig

from strata.deployments.autoscaling import StageSignalPolicy
from strata.deployments.config import SIGNALS, ServeConfig
from strata.deployments.ingress import Ingress
from strata.deployments.stage_deployments import Decode, Encode, Prefill, Preprocess


def resolve_model(config: ServeConfig) -> ServeConfig:
    """Fill in the model directory (the tiny demo model, built once, when none is given), its
    name, and an absolute host-tier directory every replica on the node shares."""
    if config.model_dir is None:
        from strata.pipeline.tiny_model import ensure_demo_model

        config.model_dir = str(ensure_demo_model())
    config.model_dir = str(Path(config.model_dir).resolve())
    config.model_name = config.model_name or Path(config.model_dir).name
    engine = config.engine
    engine.host_kv_dir = str(engine.resolved_host_kv_dir()) if engine.host_kv_blocks else engine.host_kv_dir
    engine.disk_kv_dir = str(engine.resolved_disk_kv_dir()) if engine.disk_kv_blocks else engine.disk_kv_dir
    return config


def deployment_options(config: ServeConfig, stage: str) -> dict[str, Any]:
    """Replica resources and the stage's own autoscaling policy, from its section of the config."""
    sc = config.stages[stage]
    policy = AutoscalingPolicy(
        policy_function=StageSignalPolicy,
        policy_kwargs={
            "signal": SIGNALS[stage],
            "target": config.target(stage),
            "occupancy_target": sc.kv_occupancy_target if stage == "decode" else None,
            "stage": stage,
        },
    )
    autoscaling = AutoscalingConfig(
        min_replicas=sc.min_replicas, max_replicas=sc.max_replicas, initial_replicas=sc.initial_replicas,
        upscale_delay_s=sc.upscale_delay_s, downscale_delay_s=sc.downscale_delay_s,
        metrics_interval_s=sc.metrics_interval_s, look_back_period_s=sc.look_back_period_s, policy=policy,
    )
    return {
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": sc.max_ongoing_requests,
        "max_queued_requests": sc.max_queued_requests,
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=sc.retry_after_s),
        "ray_actor_options": {"num_cpus": sc.num_cpus},
    }


def build_app(config: ServeConfig) -> serve.Application:
    config = resolve_model(config)
    config.validate()
    model, engine = config.model_dir, config.engine.to_dict()
    preprocess = Preprocess.options(**deployment_options(config, "preprocess")).bind(model, engine)
    encode = Encode.options(**deployment_options(config, "encode")).bind(model, engine)
    prefill = Prefill.options(**deployment_options(config, "prefill")).bind(model, engine)
    decode = Decode.options(**deployment_options(config, "decode")).bind(model, engine)
    ingress = Ingress.options(**deployment_options(config, "ingress"))
    return ingress.bind(preprocess, encode, prefill, decode, config.to_dict())

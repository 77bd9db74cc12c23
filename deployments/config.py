"""One config file for the whole Serve application: the engine knobs plus, per stage, its
replica resources and autoscaling policy. Plain dataclasses (no Ray), loaded from JSON::

    {"engine": {...EngineConfig...},
     "stages": {"prefill": {"max_replicas": 2, "target_per_replica": 4096}, ...},
     "model_name": "strata-demo"}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from strata.pipeline.config import EngineConfig, read_json_object, reject_unknown_keys

STAGES = ("preprocess", "encode", "prefill", "decode", "ingress", "llm")
MODES = ("aggregated", "disaggregated")
LANGUAGE_STAGES = ("prefill", "decode", "llm")  # the stages that run the decoder (and may be tensor-parallel)
# The deployments of each mode (stage name -> deployment name). Aggregated: one LLM replica is the
# HTTP ingress and runs prefill and decode over one KV pool; disaggregated: an ingress and separate
# prefill and decode deployments that hand KV over through the host tier.
DEPLOYMENTS = {
    "aggregated": {"preprocess": "Preprocess", "encode": "Encode", "llm": "LLM"},
    "disaggregated": {"preprocess": "Preprocess", "encode": "Encode", "prefill": "Prefill", "decode": "Decode",
                      "ingress": "Ingress"},
}

# What each stage's policy scales on, and how much of it one replica should carry.
SIGNALS = {
    "preprocess": "pending_images",
    "encode": "pending_images",
    "prefill": "queued_prompt_tokens",
    "decode": "running_sequences",
    "ingress": "ongoing_requests",
    "llm": "running_sequences",
}
_DEFAULT_TARGETS = {"preprocess": 8.0, "encode": 8.0, "prefill": 4096.0, "decode": 32.0, "ingress": 64.0, "llm": 32.0}


@dataclass
class StageConfig:
    """Replicas, resources and autoscaling of one deployment."""

    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    num_cpus: float = 0.0  # logical CPUs reserved per replica (0: do not limit placement); per rank with tp
    tp: int = 0  # prefill, decode, llm: tensor-parallel ranks per replica (0: the engine's tp, 1 by default)
    max_ongoing_requests: int = 256  # every open stream holds one slot
    max_queued_requests: int = 512  # per caller; past it: HTTP 429 with Retry-After (never unbounded memory)
    retry_after_s: float = 1.0
    target_per_replica: float = 0.0  # the stage signal one replica should carry (0: the stage default)
    kv_occupancy_target: float = 0.85  # decode and llm: scale up past this device-tier occupancy
    upscale_delay_s: float = 1.0
    downscale_delay_s: float = 10.0
    metrics_interval_s: float = 0.5
    look_back_period_s: float = 2.0

    def validate(self, name: str) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"stages.{name}: need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.num_cpus < 0 or self.max_ongoing_requests < 1 or self.target_per_replica < 0:
            raise ValueError(f"stages.{name}: num_cpus, target_per_replica must be >= 0, max_ongoing_requests >= 1")
        if self.max_queued_requests < 1 or self.retry_after_s < 0:
            raise ValueError(f"stages.{name}: max_queued_requests must be >= 1 and retry_after_s >= 0")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 0:
            raise ValueError(f"stages.{name}: tp must be an integer >= 0")
        if self.tp > 1 and name not in LANGUAGE_STAGES:
            raise ValueError(f"stages.{name}: only {', '.join(LANGUAGE_STAGES)} run the decoder, which is what tp "
                             "splits (the vision encoder is small and runs whole in each replica)")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(f"stages.{name}: look_back_period_s must exceed metrics_interval_s")


@dataclass
class ServeConfig:
    model_dir: str | None = None  # None: the built-in tiny demo model
    model_name: str | None = None  # the id clients send as "model" (default: the directory name)
    engine: EngineConfig = field(default_factory=EngineConfig)
    stages: dict[str, StageConfig] = field(default_factory=lambda: {s: StageConfig() for s in STAGES})
    max_image_bytes: int = 10 * 1024 * 1024  # one decoded image
    max_request_bytes: int = 16 * 1024 * 1024  # a request body, refused (413) before it is read whole
    mode: str = "aggregated"  # or "disaggregated" (see DEPLOYMENTS)
    startup_timeout_s: float = 600.0  # a request waits at most this long for a model still loading
    request_body_timeout_s: float = 30.0  # the whole body must arrive within this (else 408): stalled uploads
    # aggregated: after a stream's first token, gather its tokens up to this long per write (0: every step).
    # 5 ms keeps the per-token cost of 16 concurrent streams near the engine's (docs/architecture.md).
    stream_interval_ms: float = 5.0

    def __post_init__(self) -> None:
        for name in STAGES:
            self.stages.setdefault(name, StageConfig())

    def tp(self, stage: str) -> int:
        """Tensor-parallel ranks of one replica of ``stage`` (1 for stages without a decoder)."""
        if stage not in LANGUAGE_STAGES:
            return 1
        return self.stages[stage].tp or self.engine.tp

    def target(self, stage: str) -> float:
        return self.stages[stage].target_per_replica or _DEFAULT_TARGETS[stage]

    def validate(self) -> None:
        self.engine.validate()
        for name, stage in self.stages.items():
            if name not in STAGES:
                raise ValueError(f"unknown stage {name!r} (stages: {', '.join(STAGES)})")
            stage.validate(name)
        if self.max_request_bytes < 1024 or self.max_image_bytes < 1:
            raise ValueError("max_request_bytes must be >= 1024 and max_image_bytes >= 1")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.startup_timeout_s <= 0:
            raise ValueError("startup_timeout_s must be > 0")
        if not 0 < self.request_body_timeout_s <= 3600:
            raise ValueError("request_body_timeout_s must be > 0 and at most 3600")
        if not 0 <= self.stream_interval_ms <= 1000:
            raise ValueError("stream_interval_ms must be in [0, 1000]")
        if self.mode == "disaggregated" and not self.engine.has_lower_tiers:
            raise ValueError("the disaggregated mode runs prefill and decode in separate processes: "
                             "engine.host_kv_blocks must be > 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ServeConfig":
        reject_unknown_keys(cls, data, "unknown serve config keys")
        data = dict(data)
        defaults = _SERVE_ENGINE_DEFAULTS if data.get("mode", cls.mode) == "disaggregated" else {}
        engine = EngineConfig.from_dict({**defaults, **data.pop("engine", {})})
        stages = {}
        for name, raw in (data.pop("stages", None) or {}).items():
            reject_unknown_keys(StageConfig, raw, f"unknown keys in stages.{name}")
            stages[name] = StageConfig(**raw)
        cfg = cls(engine=engine, stages=stages, **data)
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ServeConfig":
        return cls.from_dict(read_json_object(path))


def check_tensor_parallel(config: ServeConfig, model_dir: str | Path) -> None:
    """Refuse (ShardingError, a ValueError) a stage's tp the model cannot be split into, before any
    cluster starts."""
    from strata.pipeline.model_config import load_llava_config
    from strata.pipeline.shard_plan import ShardPlan

    wanted = sorted({config.tp(stage) for stage in LANGUAGE_STAGES} - {1})
    if wanted:
        text = load_llava_config(model_dir).text
        for tp in wanted:
            ShardPlan(text, 0, tp)


# The disaggregated mode needs the host tier: prefill and decode replicas are separate processes with their
# own pools. The aggregated mode keeps one pool and writes nothing through unless a host tier is configured.
_SERVE_ENGINE_DEFAULTS: dict[str, Any] = {"host_kv_blocks": 4096}


def default_serve_config() -> ServeConfig:
    return ServeConfig.from_dict({})

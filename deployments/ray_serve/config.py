"""One config file for the whole Serve application: the engine knobs plus, per stage, its
replica resources and autoscaling policy. pydantic models (no Ray; unknown keys and mistyped values
are one-line errors naming the key's path), loaded from JSON; the schema is ``docs/config.schema.json``::

    {"engine": {...EngineConfig...},
     "stages": {"prefill": {"max_replicas": 2, "target_per_replica": 4096}, ...},
     "model_name": "strata-demo"}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from strata.pipeline.contract.config import ConfigModel, EngineConfig, config_error, read_json_object

STAGES = ("preprocess", "encode", "prefill", "decode", "ingress", "llm")
Stage = Literal["preprocess", "encode", "prefill", "decode", "ingress", "llm"]
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


class StageConfig(ConfigModel):
    """Replicas, resources and autoscaling of one deployment."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    num_cpus: float = Field(0.0, ge=0, description="logical CPUs reserved per replica (0: do not limit "
                                                    "placement); per rank with tp")
    tp: int = Field(0, ge=0, description="prefill, decode, llm: tensor-parallel ranks per replica (0: the "
                                          "engine's tp, 1 by default)")
    max_ongoing_requests: int = Field(256, ge=1, description="every open stream holds one slot")
    max_queued_requests: int = Field(512, ge=1, description="per caller; past it: HTTP 429 with Retry-After")
    retry_after_s: float = Field(1.0, ge=0)
    target_per_replica: float = Field(0.0, ge=0, description="the stage signal one replica should carry "
                                                              "(0: the stage default)")
    kv_occupancy_target: float = Field(0.85, gt=0, le=1, description="decode and llm: scale up past this "
                                                                      "device-tier occupancy")
    upscale_delay_s: float = Field(1.0, ge=0)
    downscale_delay_s: float = Field(10.0, ge=0)
    metrics_interval_s: float = Field(0.5, gt=0)
    look_back_period_s: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> "StageConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError("need min_replicas <= max_replicas")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError("look_back_period_s must exceed metrics_interval_s")
        return self


# The disaggregated mode needs the host tier: prefill and decode replicas are separate processes with their
# own pools. The aggregated mode keeps one pool and writes nothing through unless a host tier is configured.
_SERVE_ENGINE_DEFAULTS: dict[str, Any] = {"host_kv_blocks": 4096}


class ServeConfig(ConfigModel):
    """The whole Serve application: the engine knobs, each stage's deployment, and the HTTP limits."""

    model_dir: str | None = Field(None, description="the checkpoint (None: the built-in tiny demo model)")
    model_name: str | None = Field(None, description="the id clients send as \"model\" (default: the "
                                                     "Hugging Face id it was given as, else the directory name)")
    model_aliases: list[str] = Field(default_factory=list, description="other ids clients may send for it "
                                                                        "(vLLM's further --served-model-name values)")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    stages: dict[Stage, StageConfig] = Field(default_factory=dict, description="per stage; every stage not "
                                                                                "named gets the defaults")
    max_image_bytes: int = Field(10 * 1024 * 1024, ge=1, description="one decoded image")
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="a request body, refused (413) "
                                                                           "before it is read whole")
    mode: Literal["aggregated", "disaggregated"] = "aggregated"
    startup_timeout_s: float = Field(600.0, gt=0, description="a request waits at most this long for a "
                                                              "model still loading")
    request_body_timeout_s: float = Field(30.0, gt=0, le=3600, description="the whole body must arrive "
                                                                           "within this (else 408)")
    stream_interval_ms: float = Field(5.0, ge=0, le=1000, description="aggregated: after a stream's first "
                                      "token, gather its tokens up to this long per write (0: every step)")
    api_key_sha256: str | None = Field(None, pattern="^[0-9a-f]{64}$", description="hex SHA-256 of the API key "
                                       "every route but /health, /ping, /version and /metrics requires as a Bearer "
                                       "token (strata serve --api-key fills it; the key itself is never stored)")
    tool_call_parser: Literal["auto", "none", "hermes", "llama3_json", "mistral", "kimi_k2", "deepseek_v3",
                              "deepseek_v32", "minimax_m2", "glm45", "qwen3_coder", "openai"] = Field(
        "auto", description="how answers are read for tool calls: a family's syntax, auto (the one the chat template "
                            "writes) or none (requests with tools get a 400)")
    reasoning_parser: Literal["auto", "none", "deepseek_r1", "qwen3", "glm45", "kimi_k2", "minimax_m2",
                              "openai_gptoss"] = Field(
        "auto", description="how chat answers' thinking is read apart (message.reasoning_content): a family's "
                            "parser, auto (<think> tags or harmony channels where the chat template writes them) "
                            "or none")
    enable_tokenizer_info_endpoint: bool = Field(False, description="serve vLLM's GET /tokenizer_info (the "
                                                 "tokenizer's configuration and chat template, as lm-eval's remote "
                                                 "tokenizer reads them); off by default, as in vLLM")
    generation_config: str = Field("auto", min_length=1, max_length=4096, description="default sampling, as vLLM's "
                                   "--generation-config: auto (the checkpoint's generation_config.json gives a "
                                   "request's default temperature, top_p, top_k, repetition_penalty and max_tokens), "
                                   "vllm (none) or a folder holding a generation_config.json")
    chat_template: str | None = Field(None, max_length=1_000_000, description="a Jinja chat template replacing the "
                                      "checkpoint's (strata serve --chat-template reads it from a file)")
    engine_process: bool = Field(True, description="aggregated with tp 1: the step loop runs in a child process "
                                                   "of the LLM replica, with a GIL of its own (false: on a thread "
                                                   "of the replica's process)")

    @model_validator(mode="before")
    @classmethod
    def _mode_defaults(cls, data: Any) -> Any:
        """The disaggregated mode's engine defaults (a host tier), under whatever the config says."""
        if isinstance(data, dict) and data.get("mode") == "disaggregated" and isinstance(data.get("engine", {}), dict):
            data = {**data, "engine": {**_SERVE_ENGINE_DEFAULTS, **data.get("engine", {})}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "ServeConfig":
        for name in STAGES:
            if name not in self.stages:
                self.stages[name] = StageConfig()
        for name, stage in self.stages.items():
            if stage.tp > 1 and name not in LANGUAGE_STAGES:
                raise ValueError(f"stages.{name}: only {', '.join(LANGUAGE_STAGES)} run the decoder, which is what "
                                 "tp splits (the vision encoder is small and runs whole in each replica)")
        if self.mode == "disaggregated" and not self.engine.has_lower_tiers:
            raise ValueError("the disaggregated mode runs prefill and decode in separate processes: "
                             "engine.host_kv_blocks must be > 0")
        return self

    def tp(self, stage: str) -> int:
        """Tensor-parallel ranks of one replica of ``stage`` (1 for stages without a decoder)."""
        if stage not in LANGUAGE_STAGES:
            return 1
        return self.stages[stage].tp or self.engine.tp

    def target(self, stage: str) -> float:
        return self.stages[stage].target_per_replica or _DEFAULT_TARGETS[stage]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ServeConfig":
        """The config a JSON object describes; ValueError (one line, the key's path) for anything else."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise config_error(exc) from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ServeConfig":
        return cls.from_dict(read_json_object(path))


def check_tensor_parallel(config: ServeConfig, model_dir: str | Path) -> None:
    """Refuse (ShardingError, a ValueError) a stage's tp the model cannot be split into, before any
    cluster starts."""
    from strata.pipeline.models.model_config import load_model_config
    from strata.pipeline.models.model_loader import check_tensor_parallel_split

    wanted = sorted({config.tp(stage) for stage in LANGUAGE_STAGES} - {1})
    if wanted:
        cfg = load_model_config(model_dir)
        for tp in wanted:
            check_tensor_parallel_split(model_dir, cfg, tp)


def check_stage_engines(config: ServeConfig) -> None:
    """Refuse, before any cluster starts, what the model's layers or the speculative method cannot run with:
    a linear-attention model's state and DSA's indexer cross no tensor-parallel split; MTP needs the layer."""
    from strata.pipeline.models.model_config import load_model_config
    from strata.pipeline.models.mtp import check_mtp_engine, with_mtp
    from strata.stages.preflight import check_model_engine

    cfg = load_model_config(config.model_dir)
    spec = config.engine.speculative
    for stage in LANGUAGE_STAGES:
        engine = config.engine.model_copy(update={"tp": config.tp(stage)})
        check_model_engine(cfg.text, engine)
        if spec is not None and spec.method == "mtp":
            check_mtp_engine(engine.tp, engine.kv_cache_dtype)
    if spec is not None:
        with_mtp(cfg, spec.method)


def default_serve_config() -> ServeConfig:
    return ServeConfig.from_dict({})


def config_schema() -> dict[str, Any]:
    """The JSON schema of a `strata serve --config` file (published as docs/config.schema.json)."""
    return ServeConfig.model_json_schema()


if __name__ == "__main__":  # python -m strata.deployments.ray_serve.config > docs/config.schema.json
    import json

    print(json.dumps(config_schema(), indent=2))

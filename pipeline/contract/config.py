"""Typed engine configuration shared by every stage (and sent to every replica and worker).

pydantic models with ``extra="forbid"``: a misspelled key is an error naming its path, values are
strictly typed, and the JSON schema of every config comes for free (``docs/config.schema.json``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from strata.pipeline.contract.sizes import parse_budget


class ConfigModel(BaseModel):
    """A config section: unknown keys are errors (a typo is never a silent default), values are typed
    strictly (``true`` is not a number, ``"4"`` is not an int), and assignments are validated too."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def config_error(exc: ValidationError, root: str = "") -> ValueError:
    """One line for a config a model refused: the first problem, with the path of the key it is about."""
    errors = exc.errors()
    first = errors[0]
    path = ".".join(str(p) for p in (root, *first["loc"]) if p not in ("", "[key]"))  # a dict key: its own path
    if first["type"] == "extra_forbidden":
        message = f"unknown config key {path}"
    else:
        text = first["msg"].removeprefix("Value error, ")
        message = f"{path}: {text}" if path else text
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    return ValueError(message)


DType = Literal["float32", "bfloat16", "float16"]
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3"]
ModelImpl = Literal["auto", "strata", "transformers"]  # as ``models.fallback_config.MODEL_IMPLS``


class SpeculativeConfig(ConfigModel):
    """Speculative decoding, in vLLM's ``--speculative-config`` shape. ``ngram`` (prompt lookup): the draft
    is what followed the latest earlier occurrence of the sequence's last n tokens (n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``), so it costs no model and helps most where decode
    is bound by reading weights and the answer repeats its context (edits, summaries, extraction). ``mtp``:
    the checkpoint's own multi-token-prediction layer (DeepSeek-V3, GLM-4.5: ``num_nextn_predict_layers``)
    drafts the token after next from the model's last hidden state (``pipeline/core/mtp_drafts.py``)."""

    method: Literal["ngram", "mtp"] = Field(description="ngram (prompt lookup) or mtp (the checkpoint's "
                                                        "multi-token-prediction layer); a draft model is not "
                                                        "implemented")
    num_speculative_tokens: int = Field(ge=1, le=16, description="draft tokens verified per step")
    prompt_lookup_max: int | None = Field(None, ge=1, le=64, description="longest n-gram matched (default: "
                                                                          "prompt_lookup_min, or 5 when neither)")
    prompt_lookup_min: int | None = Field(None, ge=1, le=64, description="shortest n-gram matched (default: "
                                                                          "prompt_lookup_max, or 5 when neither)")

    @model_validator(mode="after")
    def _lookup_range(self) -> "SpeculativeConfig":
        if self.method == "mtp":
            if self.num_speculative_tokens != 1:
                raise ValueError("mtp drafts one token a step (the one MTP layer released checkpoints carry): "
                                 f"set num_speculative_tokens to 1, not {self.num_speculative_tokens}")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("prompt_lookup_max and prompt_lookup_min are ngram settings; mtp takes neither")
            return self
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.__dict__.update(prompt_lookup_max=5, prompt_lookup_min=5)  # vLLM's defaults
        elif self.prompt_lookup_min is None:
            self.__dict__["prompt_lookup_min"] = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.__dict__["prompt_lookup_max"] = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:  # type: ignore[operator]
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


class EngineConfig(ConfigModel):
    """Knobs of the engine core. Defaults suit the tiny demo model on a CPU."""

    dtype: DType = Field("float32", description="float32 (exact vs transformers; the CPU default) or bfloat16 "
                                                "(weights and KV; the CUDA default); float16 on CUDA")
    kv_cache_dtype: KVCacheDType = Field("auto", description="auto (the model's dtype) or fp8 (= fp8_e4m3: e4m3 "
                                         "with per-layer power-of-two scales calibrated at load; 1 byte a value "
                                         "in every tier, half of bf16's); the cpu and torch attention backends "
                                         "read it")
    model_impl: ModelImpl = Field("auto", description="auto (Strata's own model code where it has the architecture, "
                                  "else the transformers fallback: transformers' modules with Strata's paged "
                                  "attention), strata (refuse the fallback) or transformers (the fallback even "
                                  "where Strata has the architecture; text-only causal LMs); vLLM's --model-impl")
    device: str = "cpu"
    attention_backend: str = Field("auto", description="auto, cpu (paged C++ kernel + flash), torch (reference), "
                                                       "triton (CUDA)")
    compile: bool = Field(False, description="torch.compile the dense parts of a step (inductor C++ on CPU, Triton on CUDA)")
    num_threads: int = Field(0, ge=0, description="torch intra-op threads of this process (0: every core the "
                                                  "process may run on, shared among its tp ranks)")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks of a language stage (heads, MLP, experts and "
                                          "vocab split; KV heads too)")
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    num_kv_blocks: int = Field(1024, ge=1, description="device-tier capacity in blocks")
    kv_cache_memory: str | None = Field(None, description="device-tier KV budget, which sizes num_kv_blocks: bytes "
                                        "(4GiB, 512MiB, 1073741824) or a share of the memory left free by the "
                                        "weights (40%: the rest is headroom, as vLLM's --gpu-memory-utilization); "
                                        "per tensor-parallel rank")
    host_kv_blocks: int = Field(0, ge=0, description="host tier (block files on tmpfs, shared by the node's "
                                                      "processes); 0 = off")
    host_kv_dir: str | None = Field(None, description="default: /dev/shm/strata-kv-<uid>")
    disk_kv_blocks: int = Field(0, ge=0, description="disk tier (survives restarts); 0 = off")
    disk_kv_dir: str | None = Field(None, description="default: ~/.cache/strata/kv")
    kv_write_queue_blocks: int = Field(256, ge=0, description="blocks queued for the background writer of the "
                                                               "host/disk tiers (copies; 0: write on the step "
                                                               "thread); past it caching is skipped, never tokens")
    kv_prefetch_blocks: int = Field(64, ge=0, description="host/disk blocks read ahead for the prompts next in "
                                                           "line while a step runs (0: read at admission)")
    kv_staging_blocks: int = Field(64, ge=1, description="device buffer through which spilled blocks are "
                                                          "streamed to attention")
    max_num_batched_tokens: int = Field(2048, ge=1, description="per-step token budget (decodes first, then "
                                                                 "prefill chunks)")
    prefill_chunk_tokens: int = Field(512, ge=1, description="largest prefill chunk of one sequence in one step")
    max_num_seqs: int = Field(64, ge=1, description="running sequences per stage")
    max_model_len: int = Field(4096, ge=1, description="prompt + output tokens of one request")
    enable_prefix_caching: bool = True
    encoder_cache_size: int = Field(64, ge=0, description="images kept encoded, by content hash")
    encoder_batch_patches: int = Field(2048, ge=0, description="native resolution: patches the encoder packs into "
                                       "one call (images of any sizes, never padded; a larger image runs alone); "
                                       "0: every image of the call at once. On a CPU ~2K keeps the working set in "
                                       "cache (strata bench vision); a GPU wants more")
    max_image_pixels: int = Field(4096 * 4096, ge=1, description="decoded pixels of one image, at most")
    max_image_pixels_in_flight: int = Field(0, ge=0, description="decoded pixels one Preprocess replica holds at "
                                                                  "once (0: two images at max_image_pixels)")
    image_wait_timeout_s: float = Field(30.0, gt=0, description="the longest an image waits for room before its "
                                                                "request is refused as busy (429)")
    max_images_per_request: int = Field(8, ge=0)
    request_timeout_s: float = Field(600.0, ge=0, description="a request still running after this long ends "
                                                               "with an error (0: never)")
    chat_template_timeout_s: float = Field(5.0, gt=0, description="the longest the chat template may take to render "
                                           "one request's messages; past it the request is a 400")
    speculative: SpeculativeConfig | None = Field(None, description="speculative decoding (off when null): "
                                                  "drafts verified exactly, so greedy output is unchanged and "
                                                  "sampled output keeps its distribution")
    grammar_timeout_s: float = Field(10.0, gt=0, description="the longest a structured-output grammar may take to "
                                     "compile in the front door's sandbox; past it the request is a 400")

    @field_validator("kv_cache_memory")
    @classmethod
    def _budget(cls, value: str | None) -> str | None:
        if value is not None:
            parse_budget(value)  # a bad size is a config error naming the field, before anything loads
        return value

    @field_validator("host_kv_dir", "disk_kv_dir", mode="before")
    @classmethod
    def _path_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, Path) else value

    @model_validator(mode="before")
    @classmethod
    def _dtype_for_device(cls, data: Any) -> Any:
        """No dtype given: bf16 on CUDA (what GPUs serve in), fp32 elsewhere (exact on CPU)."""
        if isinstance(data, dict) and data.get("dtype") is None and str(data.get("device", "cpu")).startswith("cuda"):
            data = {**data, "dtype": "bfloat16"}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "EngineConfig":
        if self.dtype == "float16" and not self.device.startswith("cuda"):
            raise ValueError("dtype float16 runs on CUDA only; on CPU use float32 (exact) or bfloat16")
        if self.tp > 1 and self.compile:
            raise ValueError("compile is not supported with tp > 1 (the sharded layer step runs eagerly)")
        if self.max_image_pixels_in_flight and self.max_image_pixels_in_flight < self.max_image_pixels:
            # an image at the cap could never get room: it would wait out its timeout every time
            raise ValueError(f"max_image_pixels_in_flight must be 0 or >= max_image_pixels ({self.max_image_pixels}), "
                             f"got {self.max_image_pixels_in_flight}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence must be able to decode in one step
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        return self

    @property
    def image_pixels_in_flight(self) -> int:
        """The decode budget of one Preprocess replica, in pixels (``max_image_pixels_in_flight`` resolved)."""
        return self.max_image_pixels_in_flight or 2 * self.max_image_pixels

    @property
    def has_lower_tiers(self) -> bool:
        """Whether KV can leave the device (then a context may exceed the device tier)."""
        return self.host_kv_blocks > 0 or self.disk_kv_blocks > 0

    def resolved_host_kv_dir(self) -> Path:
        if self.host_kv_dir:
            return Path(self.host_kv_dir)
        shm = Path("/dev/shm")
        return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / f"strata-kv-{os.getuid()}"

    def resolved_disk_kv_dir(self) -> Path:
        return Path(self.disk_kv_dir) if self.disk_kv_dir else Path.home() / ".cache" / "strata" / "kv"

    @classmethod
    def from_dict(cls, data: dict[str, Any], root: str = "engine") -> "EngineConfig":
        """The config a JSON object describes; ValueError (one line, the key's path) for anything else."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise config_error(exc, root) from None


def json_object_flag(flag: str, text: str) -> dict[str, Any]:
    """The JSON object a command-line flag takes (``--speculative-config '{"method": "ngram", ...}'``);
    ValueError in one line naming the flag for anything else."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object")
    return value


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A config file's JSON object; ValueError with a one-line reason for anything else."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"config {path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"config {path} must hold a JSON object")
    return raw

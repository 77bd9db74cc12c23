"""Typed engine configuration shared by every stage."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass
class EngineConfig:
    """Knobs of the engine core. Defaults suit the tiny demo model on a CPU."""

    dtype: str = "float32"  # float32 (exact vs transformers) or bfloat16 (weights and KV); float16 on CUDA
    device: str = "cpu"
    attention_backend: str = "auto"  # auto, cpu (paged C++ kernel + flash), torch (reference), triton (CUDA)
    compile: bool = False  # torch.compile the dense parts of a step (CUDA graphs on CUDA); see pipeline/compiled.py
    num_threads: int = 0  # torch intra-op threads of this process (0: torch's default, one per core)
    tp: int = 1  # tensor-parallel ranks of a language stage (heads, MLP, experts and vocab split; KV heads too)
    block_size: int = 16
    num_kv_blocks: int = 1024  # device-tier capacity in blocks
    host_kv_blocks: int = 0  # host tier (block files on tmpfs, shared by the node's processes); 0 = off
    host_kv_dir: str | None = None  # default: /dev/shm/strata-kv-<uid>
    disk_kv_blocks: int = 0  # disk tier (survives restarts); 0 = off
    disk_kv_dir: str | None = None  # default: ~/.cache/strata/kv
    kv_staging_blocks: int = 64  # device buffer through which spilled blocks are streamed to attention
    max_num_batched_tokens: int = 2048  # per-step token budget (decodes first, then prefill chunks)
    prefill_chunk_tokens: int = 512  # largest prefill chunk of one sequence in one step
    max_num_seqs: int = 64  # running sequences per stage
    max_model_len: int = 4096  # prompt + output tokens of one request
    enable_prefix_caching: bool = True
    encoder_cache_size: int = 64  # images kept encoded, by content hash
    max_image_pixels: int = 4096 * 4096
    # decoded pixels one Preprocess replica holds at once (0: two images at max_image_pixels), and the
    # longest an image waits for room before its request is refused as busy (429, Retry-After)
    max_image_pixels_in_flight: int = 0
    image_wait_timeout_s: float = 30.0
    max_images_per_request: int = 8
    request_timeout_s: float = 600.0  # a request still running after this long ends with an error (0: never)

    def validate(self) -> None:
        positive = (
            "block_size", "num_kv_blocks", "max_num_batched_tokens", "prefill_chunk_tokens", "max_num_seqs",
            "max_model_len", "kv_staging_blocks",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ValueError(f"tp must be an integer >= 1, got {self.tp!r}")
        if self.tp > 1 and self.compile:
            raise ValueError("compile is not supported with tp > 1 (the sharded layer step runs eagerly)")
        for name in ("host_kv_blocks", "disk_kv_blocks", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.request_timeout_s, (int, float)) or self.request_timeout_s < 0:
            raise ValueError(f"request_timeout_s must be >= 0, got {self.request_timeout_s!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true or false, got {self.compile!r}")
        if self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {self.max_image_pixels}")
        if self.max_image_pixels_in_flight and self.max_image_pixels_in_flight < self.max_image_pixels:
            # an image at the cap could never get room: it would wait out its timeout every time
            raise ValueError(f"max_image_pixels_in_flight must be 0 or >= max_image_pixels ({self.max_image_pixels}), "
                             f"got {self.max_image_pixels_in_flight}")
        if not isinstance(self.image_wait_timeout_s, (int, float)) or not self.image_wait_timeout_s > 0:
            raise ValueError(f"image_wait_timeout_s must be > 0, got {self.image_wait_timeout_s!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence must be able to decode in one step
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")

    def apply_threads(self) -> None:
        """Give torch this process's thread budget (a serving replica's reserved CPUs)."""
        if self.num_threads > 0:
            import torch

            torch.set_num_threads(self.num_threads)

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        reject_unknown_keys(cls, data, "unknown engine config keys")
        cfg = cls(**data)
        cfg.validate()
        return cfg


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A config file's JSON object; ValueError with a one-line reason for anything else."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"config {path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"config {path} must hold a JSON object")
    return raw


def reject_unknown_keys(cls: type, data: dict[str, Any], what: str) -> None:
    """A config dict may only name fields of the dataclass ``cls``: a typo is an error, not a default."""
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"{what}: {', '.join(sorted(unknown))}")

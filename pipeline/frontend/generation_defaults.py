"""Default sampling from a checkpoint's ``generation_config.json``, as vLLM's ``--generation-config`` applies it.

``auto`` (vLLM's default) reads the file beside the weights, ``vllm`` reads none, and a folder reads the file
in it. A sampling field a request leaves out takes the file's value; one the request sets wins. The file's
``max_new_tokens`` bounds a request that sets no ``max_tokens``, never past the room its context leaves.
As in vLLM, ``do_sample`` is not read: a file that names a temperature gives that temperature. Keys vLLM
reads that Strata's sampler does not have (``min_p``) are named once at startup and left out; a value out
of range is an error that names the file and the key, before the server takes a request.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.pipeline.contract.config import read_json_object

log = logging.getLogger(__name__)
FILE = "generation_config.json"
UNSUPPORTED = ("min_p",)  # read by vLLM's generation-config defaults, no sampler here


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that leaves a field out gets instead of the OpenAI default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's max_new_tokens
    source: str = ""  # the file read ("" when none)
    ignored: tuple[str, ...] = field(default=())

    def applied(self) -> dict[str, float | int]:
        """The defaults in force, by request field name (for the startup log and ``/strata/stats``)."""
        names = ("temperature", "top_p", "top_k", "repetition_penalty", "max_tokens")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


def load_generation_defaults(spec: str, model_dir: Path) -> GenerationDefaults:
    """The defaults ``spec`` names (``auto``, ``vllm`` or a folder); ValueError for an unreadable file or a
    value out of range."""
    if spec == "vllm":
        return GenerationDefaults()
    path = (model_dir if spec == "auto" else Path(spec)) / FILE
    if not path.is_file():
        if spec == "auto":
            return GenerationDefaults()
        raise ValueError(f"--generation-config {spec}: no {FILE} in that folder")
    raw = read_json_object(path)
    defaults = GenerationDefaults(
        temperature=_number(raw, "temperature", 0.0, 2.0, low_open=False),
        top_p=_number(raw, "top_p", 0.0, 1.0, low_open=True),
        top_k=_count(raw, "top_k", minimum=-1),
        repetition_penalty=_number(raw, "repetition_penalty", 0.0, 10.0, low_open=True),
        max_tokens=_count(raw, "max_new_tokens", minimum=1),
        source=FILE,
        ignored=tuple(k for k in UNSUPPORTED if raw.get(k) not in (None, 0, 0.0)),
    )
    if defaults.ignored:
        log.warning("%s sets %s, which Strata's sampler does not have: left out", FILE, ", ".join(defaults.ignored))
    if defaults.applied():
        log.info("default sampling from %s: %s (a request's own values win)", FILE, defaults.applied())
    return defaults


def _number(raw: dict[str, Any], key: str, low: float, high: float, low_open: bool) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (low < value if low_open else low <= value) or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{FILE}: {key} must be a number in {bracket}{low:g}, {high:g}], got {value!r}")
    return float(value)


def _count(raw: dict[str, Any], key: str, minimum: int) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{FILE}: {key} must be an integer >= {minimum}, got {value!r}")
    return value

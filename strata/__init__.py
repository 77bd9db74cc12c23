"""Strata: serve LLaVA-style vision-language models as a pipeline of Ray Serve stages.

One import package. The rooms are its subpackages, mapped from the repository's top-level
folders (``strata.kernels`` from ``kernels/``, ... see ``pyproject.toml``), so nothing generic
lands in site-packages. This top module is the entry room; it imports nothing at import time
(every ``strata.<room>`` import runs it first), and offers the in-process engine lazily::

    import strata
    engine = strata.load_engine("/path/to/checkpoint")
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "load_engine":
        from strata.cli import load_engine

        return load_engine
    if name == "EngineConfig":
        from strata.pipeline.contract.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from strata.pipeline.contract.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'strata' has no attribute {name!r}")

"""Strata: serve LLaVA-style vision-language models as a pipeline of Ray Serve stages.

One import package. The rooms are its subpackages, mapped from the repository's top-level
folders (``strata.kernels`` from ``kernels/``, ... see ``pyproject.toml``), so nothing generic
lands in site-packages. This top module is the entry room; it imports nothing at import time
(every ``strata.<room>`` import runs it first), and offers the offline API lazily, in vLLM's shape::

    import strata
    llm = strata.LLM("/path/to/checkpoint", dtype="bfloat16")
    print(llm.generate(["The capital of France is"], strata.SamplingParams(max_tokens=8))[0].outputs[0].text)

``strata.load_engine`` is the level below (the in-process engine: requests, steps, token events).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "load_engine", "EngineConfig", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "load_engine"):
        from strata import offline

        return getattr(offline, name)
    if name == "EngineConfig":
        from strata.pipeline.contract.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from strata.pipeline.contract.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'strata' has no attribute {name!r}")

"""The sanity rules a config's sizes obey, for the config components to read their fields through.

A checkpoint's ``config.json`` is data from outside: ``num_hidden_layers: 1e12`` once reached a tuple of a
trillion entries (a ``MemoryError``), ``num_attention_heads: 0`` a ``ZeroDivisionError``, and a negative
layer count a plan of negative blocks. A size read here is an integer (not a bool, a float or a string),
positive, and within a bound where the code builds something per unit (layers); a bad one is a
:class:`ModelConfigError` naming the field and its value, before anything is built or allocated.
"""

from __future__ import annotations

from typing import Any

from strata.pipeline.models.config_errors import ModelConfigError

MAX_LAYERS = 4096  # the deepest released models have ~130; per-layer tables are built from the count
_REQUIRED = object()


def size(section: dict[str, Any], key: str, default: Any = _REQUIRED, *, maximum: int | None = None,
         where: str = "config.json") -> int:
    """``section[key]`` as a positive int (``default`` when absent, if given): ModelConfigError otherwise."""
    value = section.get(key, default) if default is not _REQUIRED else section.get(key, _REQUIRED)
    if value is _REQUIRED:
        raise ModelConfigError(f"{where} is missing required field {key!r}")
    return checked_size(value, key, maximum=maximum, where=where)


def checked_size(value: Any, key: str, *, maximum: int | None = None, where: str = "config.json") -> int:
    """``value`` (the field ``key``) as a positive int: ModelConfigError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelConfigError(f"{where}: {key} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ModelConfigError(f"{where}: {key} must be positive, got {value}")
    if maximum is not None and value > maximum:
        raise ModelConfigError(f"{where}: {key} is {value}; at most {maximum} is supported")
    return value


def divides(part: int, part_key: str, whole: int, whole_key: str, where: str = "config.json") -> None:
    """``whole`` splits into equal parts of ``part``."""
    if whole % part:
        raise ModelConfigError(f"{where}: {whole_key} ({whole}) is not a multiple of {part_key} ({part})")

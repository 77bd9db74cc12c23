"""The weight-format lines of `strata ops`: which format each quantized module role is stored in, and
which kernel computes it, read by the scheme the loader uses (``models.weight_formats``).

A role is a module's name with its layer and expert numbers folded (``layers.*.mlp.experts.*.gate_proj``),
so a 61-layer model is a few lines. A quantization tensor that the config's scheme does not read is
unclaimed (``ops`` fails on it as the loader would).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.weight_formats import QuantScheme, is_quant_tensor, parse_quantization

_NUMBERS = re.compile(r"\.\d+\.")
ABSORBED = "dequantized once at load: MLA's absorbed form splits it per head (pipeline.models.attention_mla)"


def _role(module: str) -> str:
    while _NUMBERS.search(module):
        module = _NUMBERS.sub(".*.", module)
    return module


def format_lines(raw: dict[str, Any], names: list[str]) -> tuple[list[tuple[str, str, str | None]], list[str]]:
    """([(component, needs, implemented by or None)], quantization tensors nothing claims)."""
    try:
        scheme = parse_quantization(raw)
    except ModelConfigError as exc:
        return [("weight format", str(exc), None)], []
    quant = [n for n in names if is_quant_tensor(n)]
    if scheme is None:
        return [], quant
    lines, unclaimed = _formats(scheme, names)
    return [("weight format", scheme.describe(), "pipeline.models.weight_formats"), *lines], \
        [n for n in quant if n in unclaimed or not _read_by(scheme, n, names)]


def _formats(scheme: QuantScheme, names: list[str]) -> tuple[list[tuple[str, str, str | None]], set[str]]:
    roles: Counter[tuple[str, str, str]] = Counter()
    refused: set[str] = set()
    held = set(names)
    for name in names:
        module, _, leaf = name.rpartition(".")
        if leaf not in scheme.markers() or (leaf == "scale" and f"{module}.weight" not in held):
            continue  # a bare ``scale`` is a parameter of its own, as the loader reads it (``quantized_modules``)
        try:
            fmt = scheme.format_of(module, leaf)
        except ModelConfigError:
            refused.add(name)
            continue
        kernel = ABSORBED if module.endswith(".kv_b_proj") else fmt.kernel()
        roles[(_role(module), fmt.name(), kernel)] += 1
    return [("  stored", f"{role} in {fmt} ({count})", kernel) for (role, fmt, kernel), count in sorted(roles.items())], refused


def _read_by(scheme: QuantScheme, name: str, names: list[str]) -> bool:
    """Whether ``name`` is one of the tensors of a module whose marker the scheme reads."""
    module, _, leaf = name.rpartition(".")
    present = set(names)
    for group in scheme.groups:
        fmt = group.format
        if leaf in fmt.suffixes() and f"{module}.{fmt.marker()}" in present:
            return True
    return False

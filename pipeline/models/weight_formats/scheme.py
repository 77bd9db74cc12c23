"""A checkpoint's ``quantization_config``, read into the formats its linears are stored in, or refused.

Read with the rest of config.json, before any weight: a method, format, bit width or scheme Strata
does not implement is refused in one line that names it, never loaded as bytes without their meaning.
Which linears are quantized is what the checkpoint holds: a linear whose format's marker tensor
(``weight_scale_inv``, ``weight_packed``, ...) is present. The config's groups say which format a
marked linear is in (their ``targets``), and its ``ignore`` list which linears must be dense.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, replace
from typing import Any

from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.weight_formats.format import WeightFormat
from strata.pipeline.models.weight_formats.fp8_block import FP8Block
from strata.pipeline.models.weight_formats.fp8_row import FP8Row
from strata.pipeline.models.weight_formats.ggml_block import GGML_KINDS, GGMLBlock
from strata.pipeline.models.weight_formats.int4_group import Int4Group
from strata.pipeline.models.weight_formats.mxfp4 import MXFP4, MXFP4Experts

IMPLEMENTED = ("fp8 (e4m3 block scales; DeepSeek-V4's fp4 experts), compressed-tensors pack-quantized INT4 "
               "(groups), float-quantized FP8 (tensor, channel or block scales), mxfp4-pack-quantized MXFP4, "
               "gpt-oss's mxfp4 expert blocks, and GGUF's q4_0, q4_1 and q8_0 blocks")
QUANT_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_packed", "weight_zero_point", "weight_shape",
                  "input_scale", "weight_global_scale", "input_global_scale", "qweight", "qzeros", "scales", "g_idx",
                  "blocks", "weight_blocks", "weight_scales",
                  *(f"weight_{k}" for k in GGML_KINDS))  # tensors that are no weight on their own


def is_quant_tensor(name: str) -> bool:
    """A scale, packed codes, a zero point or a shape: bytes that mean nothing without their format."""
    return name.rpartition(".")[2] in QUANT_SUFFIXES or name.endswith(("_blocks", "_scales"))


@dataclass(frozen=True)
class FormatGroup:
    targets: tuple[str, ...]  # class names ("Linear") or names / "re:" patterns of modules
    format: WeightFormat

    def covers(self, module: str) -> bool:
        return any(t == "Linear" or _matches(t, module) for t in self.targets)


@dataclass(frozen=True)
class QuantScheme:
    method: str
    groups: tuple[FormatGroup, ...]
    ignore: tuple[str, ...] = ()

    def format_of(self, module: str, marker: str) -> WeightFormat:
        """The format of checkpoint module ``module``, which holds the tensor ``module.marker``."""
        if any(_matches(t, module) for t in self.ignore):
            raise ModelConfigError(f"tensor {module}.{marker}: the quantization_config's ignore list says {module} "
                                   "is not quantized")
        for group in self.groups:
            if group.format.marker() == marker and group.covers(module):
                return group.format
        raise ModelConfigError(f"tensor {module}.{marker}: no group of the quantization_config covers {module}")

    def format_for(self, module: str) -> WeightFormat | None:
        """The format this scheme's rules store a linear named ``module`` in (None: dense): what the planner
        sizes from the config alone, without the tensors that settle it for the loader."""
        if any(_matches(t, module) for t in self.ignore):
            return None
        return next((g.format for g in self.groups if g.covers(module)), None)

    def markers(self) -> set[str]:
        return {g.format.marker() for g in self.groups}

    def describe(self) -> str:
        return f"{self.method}: " + ", ".join(sorted({g.format.name() for g in self.groups}))


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def parse_quantization(raw: dict[str, Any]) -> QuantScheme | None:
    """The scheme of a config.json (top level, or its text config's), None for a dense checkpoint."""
    qc = raw.get("quantization_config")
    if qc is None:
        qc = (raw.get("text_config") or {}).get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelConfigError("quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8({"expert_dtype": raw.get("expert_dtype", "fp8"), **qc})  # V4 has it at the top level
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "gguf":
        return _gguf(qc)
    if method == "mxfp4":
        return _gpt_oss_mxfp4(qc)
    raise ModelConfigError(f"quantization_config: quant_method {method!r} is not implemented (Strata reads {IMPLEMENTED})")


def _fp8(qc: dict[str, Any]) -> QuantScheme:
    """DeepSeek's FP8 release: block scales under ``weight_scale_inv`` (V3, Kimi-K2, GLM, MiniMax) or ``scale``
    (V4); with ``expert_dtype: fp4`` (V4) the routed experts are FP4 codes with an E8M0 scale per 32 inputs."""
    block = _fp8_block(qc)
    groups = [FormatGroup(("Linear",), block), FormatGroup(("Linear",), replace(block, scale_suffix="scale"))]
    expert_dtype = qc["expert_dtype"]
    if expert_dtype == "fp4":
        experts = r"re:.*\.experts\.\d+\.(w[123]|gate_proj|up_proj|down_proj)$"  # the release's names, and ours
        groups.insert(0, FormatGroup((experts,), MXFP4(packed_suffix="weight", scale_suffix="scale")))
    elif expert_dtype != "fp8":
        raise ModelConfigError(f"quantization_config: fp8 expert_dtype {expert_dtype!r} is not implemented "
                               "(fp8 or fp4)")
    return QuantScheme("fp8", tuple(groups))


def _fp8_block(qc: dict[str, Any]) -> FP8Block:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelConfigError(f"quantization_config: fp8 fmt {fmt!r} is not implemented (only e4m3)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelConfigError(f"quantization_config: fp8 activation_scheme {qc.get('activation_scheme')!r} is not "
                               "implemented (only dynamic: activations stay in the compute dtype)")
    if qc.get("scale_fmt") not in (None, "float", "ue8m0"):  # ue8m0: powers of two (V3.1 as float32, V4 as e8m0)
        raise ModelConfigError(f"quantization_config: fp8 scale_fmt {qc.get('scale_fmt')!r} is not implemented")
    block = qc.get("weight_block_size")
    if block is None:
        raise ModelConfigError("quantization_config: fp8 without weight_block_size (per-tensor fp8) is not "
                               "implemented; use compressed-tensors float-quantized")
    return FP8Block(*_block(block))


def _gguf(qc: dict[str, Any]) -> QuantScheme:
    """A GGUF read into a checkpoint (``pipeline.models.gguf_source``): each block type its tensors use, the
    most used first (the planner sizes linears by the first); a tensor's name says which it is in."""
    kinds = qc.get("ggml_types")
    if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds):
        raise ModelConfigError("quantization_config: gguf needs ggml_types, a list of block types")
    unknown = [k for k in kinds if k not in GGML_KINDS]
    if unknown:
        raise ModelConfigError(f"quantization_config: GGUF block type {unknown[0]!r} is not implemented "
                               f"(Strata keeps {', '.join(GGML_KINDS)})")
    return QuantScheme("gguf", tuple(FormatGroup(("Linear",), GGMLBlock(k)) for k in kinds))


def _gpt_oss_mxfp4(qc: dict[str, Any]) -> QuantScheme:
    """gpt-oss's own config: its routed experts in MXFP4 blocks, ``modules_to_not_convert`` (globs) dense."""
    keep = qc.get("modules_to_not_convert") or []
    if not isinstance(keep, list) or not all(isinstance(t, str) for t in keep):
        raise ModelConfigError("quantization_config: modules_to_not_convert must be a list of module names")
    experts = FormatGroup((r"re:.*\.mlp\.experts(\..*)?$",), MXFP4Experts())
    return QuantScheme("mxfp4", (experts,), tuple("re:" + fnmatch.translate(t) for t in keep))


def _block(block: Any) -> tuple[int, int]:
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 1 << 16 for b in block)):
        raise ModelConfigError(f"quantization_config: a weight block size must be two positive integers, not {block!r}")
    return block[0], block[1]


def _compressed_tensors(qc: dict[str, Any]) -> QuantScheme | None:
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ModelConfigError(f"quantization_config: quantization_status {status!r} is not implemented (the weights "
                               "must be stored compressed)")
    if qc.get("kv_cache_scheme"):
        raise ModelConfigError("quantization_config: a kv_cache_scheme (KV scales in the checkpoint) is not implemented")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ModelConfigError("quantization_config: compressed-tensors without config_groups")
    parsed = []
    for label, group in groups.items():
        if not isinstance(group, dict):
            raise ModelConfigError(f"quantization_config: config group {label!r} is not an object")
        fmt = group.get("format") or qc.get("format")
        targets = group.get("targets") or ["Linear"]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise ModelConfigError(f"quantization_config: group {label!r} targets must be a list of names")
        parsed.append(FormatGroup(tuple(targets), _ct_format(label, fmt, group)))
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise ModelConfigError("quantization_config: ignore must be a list of module names")
    return QuantScheme("compressed-tensors", tuple(parsed), tuple(ignore))


def _ct_format(label: str, fmt: Any, group: dict[str, Any]) -> WeightFormat:
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ModelConfigError(f"quantization_config: group {label!r} quantizes no weights")
    acts = group.get("input_activations")
    if acts is not None and not (isinstance(acts, dict) and acts.get("dynamic") in (True, "local")):
        raise ModelConfigError(f"quantization_config: group {label!r} has static input activation scales, "
                               "which are not implemented (only weight-only or dynamic activation schemes)")
    if group.get("output_activations"):
        raise ModelConfigError(f"quantization_config: group {label!r} quantizes output activations (not implemented)")
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    what = f"group {label!r}: {fmt} {kind}{bits} {strategy}"
    if fmt == "pack-quantized" and kind == "int" and bits == 4 and strategy == "group":
        size = w.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ModelConfigError(f"quantization_config: {what} needs a positive group_size, not {size!r}")
        if w.get("actorder") not in (None, False, "static"):  # "group"/"weight" reorder columns: a g_idx tensor
            raise ModelConfigError(f"quantization_config: {what} with actorder {w.get('actorder')!r} is not implemented")
        return Int4Group(size, bool(w.get("symmetric", True)))
    if fmt == "mxfp4-pack-quantized" and kind == "float" and bits == 4 and strategy == "group":
        if w.get("group_size") != 32 or not w.get("symmetric", True):
            raise ModelConfigError(f"quantization_config: {what} needs symmetric groups of 32 (MXFP4), not "
                                   f"group_size {w.get('group_size')!r}")
        return MXFP4()
    if fmt == "float-quantized" and kind == "float" and bits == 8 and w.get("symmetric", True):
        if strategy in ("tensor", "channel"):
            return FP8Row(per_channel=strategy == "channel")
        if strategy == "block":
            return FP8Block(*_block(w.get("block_structure")), scale_suffix="weight_scale")
    raise ModelConfigError(f"quantization_config: {what} is not implemented (Strata reads {IMPLEMENTED})")

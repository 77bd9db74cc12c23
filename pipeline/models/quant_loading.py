"""The loader's side of quantized checkpoints: which modules are stored quantized, which tensors they
claim, which slice of each a rank reads, and their weights built as their tensors stream in.

A linear is quantized when the checkpoint holds its format's marker tensor; the scheme says which
format that is. Per-expert tensors (``experts.7.gate_proj.weight_scale_inv``) are gathered per expert
and stacked when the layer's last expert arrives, gate and up rows fused as in the dense layout.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from torch import nn

from strata.kernels.quant_weight import QuantWeight, cat_rows, stack_experts
from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.quant_modules import QuantEmbedding, QuantExperts, QuantLinear, install
from strata.pipeline.models.weight_formats import Int4Group, QuantScheme, WeightFormat, WeightFormatError

if TYPE_CHECKING:
    from strata.pipeline.parallel.shard_plan import ShardPlan

_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class QuantLoadError(ValueError):
    """A quantized checkpoint that cannot be loaded as its config says; the message names the tensor."""


def _split(name: str) -> tuple[str, str]:
    module, _, leaf = name.rpartition(".")
    return module, leaf


def quantized_modules(scheme: QuantScheme, names: list[tuple[str, str]]) -> dict[str, WeightFormat]:
    """Our module name (a stack of experts by its stack's name) -> its format, for every module whose
    format's marker the checkpoint holds. ``names``: (checkpoint name, our name) of the text part's tensors."""
    markers = scheme.markers()
    held = {ckpt for ckpt, _ in names}
    formats: dict[str, WeightFormat] = {}
    for ckpt, ours in names:
        ckpt_module, leaf = _split(ckpt)
        if leaf not in markers or (leaf == "scale" and f"{ckpt_module}.weight" not in held):
            continue  # a bare ``scale`` is a parameter of its own (V4's ``attn_hc.scale``), not a weight's
        fmt = scheme.format_of(ckpt_module, leaf)
        module = _split(ours)[0]
        m = _EXPERT.match(module)
        key = m.group(1) if m else module
        if formats.setdefault(key, fmt) != fmt:
            raise ModelConfigError(f"tensor {ckpt}: the experts of {key} are stored in different formats")
    return formats


def check_tp_split(formats: dict[str, WeightFormat], plans: "list[ShardPlan]") -> None:
    """Every rank's slice of every quantized tensor starts on a block or group boundary, checked before any
    rank starts (the loader asks the same ``part_slice``); ``WeightFormatError`` names the first that does not."""
    for module, fmt in formats.items():
        if module.endswith(".experts"):
            continue  # experts are split whole
        for plan in plans:
            cut = plan.slice_for(f"{module}.weight")
            if cut is not None:
                for suffix in fmt.suffixes():
                    fmt.part_slice(module, suffix, *cut)


class QuantCollector:
    """One load's quantized modules. ``names``: (checkpoint name, our name) of the text part's tensors."""

    def __init__(self, scheme: QuantScheme, model: nn.Module, names: list[tuple[str, str]],
                 shard: "ShardPlan | None" = None) -> None:
        self.scheme, self.model, self.shard = scheme, model, shard
        self.formats = quantized_modules(scheme, names)
        install(model, self.formats)
        self.parts: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        self.experts: dict[str, dict[tuple[int, str], QuantWeight]] = defaultdict(dict)

    def claims(self, name: str) -> bool:
        """Whether ``name`` (ours) is a tensor of a quantized module (a bias is the module's own parameter)."""
        module, leaf = _split(name)
        m = _EXPERT.match(module)
        fmt = self.formats.get(m.group(1) if m else module)
        return fmt is not None and leaf in fmt.suffixes()

    def expert_of(self, name: str) -> int | None:
        m = _EXPERT.match(_split(name)[0])
        return int(m.group(2)) if m else None

    def slice_for(self, name: str) -> tuple[int, int, int] | None:
        """This rank's slice of tensor ``name`` (experts are split whole; their tensors are read whole)."""
        if self.shard is None:
            return None
        module, leaf = _split(name)
        if _EXPERT.match(module):
            return None
        if hasattr(self.formats[module], "build_experts"):  # a whole stack in one tensor: this rank's experts
            return (0, *self.shard.experts)
        cut = self.shard.slice_for(f"{module}.weight")
        if cut is None:
            return None
        return self.formats[module].part_slice(module, leaf, *cut)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        module, leaf = _split(name)
        parts = self.parts[module]
        parts[leaf] = tensor
        m = _EXPERT.match(module)
        fmt = self.formats[m.group(1) if m else module]
        if not all(s in parts for s in fmt.suffixes()):
            return
        del self.parts[module]
        try:
            if m is None:
                target = self.model.get_submodule(module)
                if isinstance(target, QuantExperts) and hasattr(fmt, "build_experts"):  # gpt-oss's stacked blocks
                    target.gate_up_proj, target.down_proj = fmt.build_experts(
                        module, target.num_experts, target.hidden, target.intermediate, parts)
                    return
                if isinstance(target, QuantEmbedding):  # a table: one row per token
                    target.weight = fmt.build(module, target.num_embeddings, target.embedding_dim, parts)
                    return
                assert isinstance(target, QuantLinear)
                self._check_shape(fmt, name, parts, target.out_features, target.in_features)
                target.weight = fmt.build(module, target.out_features, target.in_features, parts)
            else:
                self._add_expert(fmt, m.group(1), int(m.group(2)), _PROJ.get(m.group(3), m.group(3)), parts)
        except WeightFormatError as exc:
            raise QuantLoadError(str(exc)) from None

    def _check_shape(self, fmt: WeightFormat, name: str, parts: dict[str, torch.Tensor], rows: int, cols: int) -> None:
        if isinstance(fmt, Int4Group) and self.slice_for(name) is None:
            fmt.check_shape_tensor(_split(name)[0], parts["weight_shape"], rows, cols)

    def _add_expert(self, fmt: WeightFormat, stack: str, expert: int, proj: str, parts: dict[str, torch.Tensor]) -> None:
        target = self.model.get_submodule(stack)
        assert isinstance(target, QuantExperts)
        first = self.shard.experts[0] if self.shard is not None else 0
        local = expert - first
        if not 0 <= local < target.num_experts:
            raise QuantLoadError(f"tensor {stack}.{expert}.{proj}: expert {expert} is past the config's "
                                 f"{target.num_experts} experts")
        rows, cols = (target.hidden, target.intermediate) if proj == "down_proj" else (target.intermediate, target.hidden)
        name = f"{stack}.{expert}.{proj}"
        self._check_shape(fmt, name + ".weight_shape", parts, rows, cols)
        held = self.experts[stack]
        held[(local, proj)] = fmt.build(name, rows, cols, parts)
        if len(held) < 3 * target.num_experts:
            return
        e = range(target.num_experts)
        target.gate_up_proj = stack_experts([cat_rows([held[(i, "gate_proj")], held[(i, "up_proj")]]) for i in e])
        target.down_proj = stack_experts([held[(i, "down_proj")] for i in e])
        del self.experts[stack]

    def missing(self) -> list[str]:
        """Quantized modules some of whose tensors never arrived."""
        out = []
        for name, module in self.model.named_modules():
            if isinstance(module, (QuantLinear, QuantEmbedding)) and module.weight is None:
                out.append(f"{name}.weight")
            elif isinstance(module, QuantExperts) and (module.gate_up_proj is None or module.down_proj is None):
                out.append(f"{name}.*")
        return out

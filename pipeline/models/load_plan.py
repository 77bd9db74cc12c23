"""Which checkpoint tensors a load reads, and why it reads no other: the loader follows this plan, and
``strata ops`` prints the same plan, so bring-up cannot say "covered" for a checkpoint the loader refuses.

Each tensor of a checkpoint is one of:

* **read**: a parameter of the modules being loaded owns it (or a quantized module claims it);
* **skipped**: a part this load does not build (another stage's), an expert another rank holds, a
  rotary table we compute, or a tensor outside the decoder layers that no parameter needs;
* **past the decoder**: a layer past ``num_hidden_layers`` (DeepSeek's and GLM's multi-token
  prediction), which serving does not run;
* **refused**: no name rule of the architecture maps it, a decoder layer's tensor no parameter owns
  (the model would run without it: a component the architecture lacks), or quantization bytes the
  config does not declare. A refused tensor makes the load fail, naming it.

And each parameter no read tensor fills is **unfilled** (a load fails on it, after reading).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from torch import nn

from strata.pipeline.models.architectures import ModelArchitecture
from strata.pipeline.models.weight_formats import is_quant_tensor

if TYPE_CHECKING:
    from strata.pipeline.models.quant_loading import QuantCollector
    from strata.pipeline.parallel.shard_plan import ShardPlan

EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|down_proj|up_proj)\.weight$")
EXPERT_KIND = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2", "down_proj": "w2"}
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass
class LoadPlan:
    reads: list[tuple[str, str, str]] = field(default_factory=list)  # (checkpoint name, part, our name)
    skipped: int = 0
    past_decoder: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint name, why)
    unfilled: dict[str, list[str]] = field(default_factory=dict)  # part -> parameters no tensor fills

    def unclaimed(self) -> list[str]:
        """The checkpoint names the load refuses, sorted."""
        return sorted(name for name, _ in self.refused)


def plan_load(names: Iterable[str], modules: dict[str, nn.Module], arch: ModelArchitecture,
              quantized: "QuantCollector | None" = None, shard: "ShardPlan | None" = None) -> LoadPlan:
    """The plan for loading ``modules`` (part -> module, built on any device) from a checkpoint holding
    ``names``."""
    plan = LoadPlan()
    owned = {part: param_names(m) for part, m in modules.items()}
    filled: dict[str, set[str]] = {part: set() for part in modules}
    layers = getattr(getattr(modules.get("text"), "cfg", None), "num_layers", None)
    for ckpt_name in names:
        target = arch.map_name(ckpt_name)
        if target is None:
            plan.refused.append((ckpt_name, f"tensor {ckpt_name} matches no name rule of {arch.name}"))
            continue
        part, name = target
        if part not in modules:
            plan.skipped += 1
            continue
        owners = owner_names(name, modules[part])
        if part == "text" and quantized is not None and quantized.claims(name):
            expert = quantized.expert_of(name) if shard is not None else None
        elif owners[0] in owned[part]:
            expert = shard.expert_of(name) if shard is not None and part == "text" else None
            filled[part].update(owners)
        else:
            _not_owned(plan, ckpt_name, part, name, layers, arch)
            continue
        if expert is not None and not shard.holds_expert(expert):  # type: ignore[union-attr]
            plan.skipped += 1
            continue
        plan.reads.append((ckpt_name, part, name))
    for part, module in modules.items():
        lacking = sorted(owned[part] - filled[part] - _tied(part, module))
        if lacking:
            plan.unfilled[part] = lacking
    return plan


def _not_owned(plan: LoadPlan, ckpt_name: str, part: str, name: str, layers: int | None,
               arch: ModelArchitecture) -> None:
    layer = _LAYER.match(name) if part == "text" else None
    if layer is not None and layers is not None and int(layer.group(1)) >= layers:
        plan.past_decoder.append(ckpt_name)
    elif is_quant_tensor(name):
        plan.refused.append((ckpt_name, f"tensor {ckpt_name} is claimed by no component: the checkpoint is "
                                        "quantized in a way its config.json's quantization_config does not say"))
    elif layer is not None and not name.endswith("rotary_emb.inv_freq"):
        plan.refused.append((ckpt_name, f"tensor {ckpt_name} of a decoder layer is owned by no parameter of this "
                                        f"{arch.name} model: it would run without it (a component this checkpoint "
                                        "needs that the architecture does not have)"))
    else:
        plan.skipped += 1


def _tied(part: str, module: nn.Module) -> set[str]:
    """An output head tied to the embedding is filled from it, not from a tensor of its own."""
    cfg = getattr(module, "cfg", None)
    return {"lm_head.weight"} if part == "text" and getattr(cfg, "tie_word_embeddings", False) else set()


def param_names(module: nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters(remove_duplicate=False)}


def owner_names(name: str, module: nn.Module | None = None) -> tuple[str, ...]:
    """The model parameters a checkpoint tensor fills, the first the one that decides whether it is ours:
    classic per-expert tensors fill a stacked one; a fused tensor the module splits itself fills those its
    ``owners_of`` names."""
    owners_of = getattr(module, "owners_of", None)
    if owners_of is not None and (owners := owners_of(name)) is not None:
        return owners
    m = EXPERT.match(name)
    if not m:
        return (name,)
    kind = "down_proj" if EXPERT_KIND[m.group(3)] == "w2" else "gate_up_proj"
    return (f"layers.{m.group(1)}.mlp.experts.{kind}",)

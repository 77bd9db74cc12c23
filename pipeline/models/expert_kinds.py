"""Expert kinds: what one routed expert computes and how its checkpoint stores it, one object per kind.

SwiGLU experts (Mixtral, Qwen-MoE, DeepSeek, GLM, MiniMax) store ``gate_proj``/``up_proj``/``down_proj``
per expert. gpt-oss's clamp the gate and up activations, add one to up, carry biases, and store each layer's
experts stacked as ``x @ W`` with gate and up columns interleaved. A kind reads its config keys
(``settings``), says whether its tensors carry biases and need restacking, and writes its part of the
``strata ops`` line; the activation that computes it is found by ``method`` in one table
(``models.moe.EXPERT_ACTIVATIONS``). Torch-free, like the other kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.pipeline.models.config_errors import ModelConfigError


@dataclass(frozen=True)
class ExpertKind:
    name: str
    method: str  # "swiglu" | "clamped-swiglu" | "clamped-silu": the activation in ``models.moe.EXPERT_ACTIVATIONS``
    bias: bool = False  # gate/up and down carry biases
    interleaved_gate_up: bool = False  # stacked x @ W with gate and up columns interleaved (restacked at load)
    clamped: bool = False  # reads ``swiglu_alpha`` and ``swiglu_limit``

    def settings(self, tc: dict[str, Any]) -> dict[str, float]:
        """The activation's constants from a text config (the defaults where this kind has none)."""
        if not self.clamped:
            return {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
        return {"swiglu_alpha": _positive(tc, "swiglu_alpha", 1.702), "swiglu_limit": _positive(tc, "swiglu_limit", 7.0)}

    def describe(self, alpha: float, limit: float) -> str:
        """What ``strata ops`` adds to the MoE line ('' for plain SwiGLU experts)."""
        if self.method == "clamped-silu":
            return f"; SwiGLU clamped at {limit:g}"
        return f"; SwiGLU clamped at {limit:g} (alpha {alpha:g}), up + 1, biases" if self.clamped else ""


def _positive(tc: dict[str, Any], key: str, default: float) -> float:
    value = tc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelConfigError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


SWIGLU = ExpertKind("SwiGLU", "swiglu")
CLAMPED_SWIGLU = ExpertKind("clamped SwiGLU", "clamped-swiglu", bias=True, interleaved_gate_up=True, clamped=True)  # gpt-oss
# DeepSeek-V4: SwiGLU with the gate clamped from above and the up from both sides (shared experts too)
CLAMPED_SILU = ExpertKind("clamped SwiGLU", "clamped-silu", clamped=True)

"""Router kinds: how a sparse layer chooses its experts and weighs them, one object per kind.

A kind knows everything about its router that is not arithmetic on tensors: the config keys it reads
(``routing``), the tensors it owns (``tensors``), what the loader must keep in fp32, and its line in
``strata ops`` (``describe``). The torch code that computes a kind is found by its ``method`` in one table
(``models.moe.ROUTES``), so a new router is one object here, a row there (if its arithmetic is new) and the
families that use it. Which layers are sparse is the family's rule (``models.sparse_layers``), not the
router's. This module stays torch-free: bring-up and the planner read it without building a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.pipeline.models.config_errors import ModelConfigError


@dataclass(frozen=True)
class Routing:
    """A parsed router's settings, the same fields whatever the kind (a kind without groups has one)."""

    renormalize: bool  # divide the chosen weights by their sum
    scaling: float = 1.0  # multiply the chosen weights (DeepSeek's routed_scaling_factor)
    n_group: int = 1
    topk_group: int = 1


@dataclass(frozen=True)
class RouterKind:
    """One way of routing. ``method`` names its arithmetic in ``models.moe.ROUTES``."""

    name: str  # what ``strata ops`` calls it
    method: str  # "softmax" (top-k of a softmax), "sigmoid" (bias-corrected, group-limited top-k of sigmoid
    # scores), "topk-softmax" (softmax over the k best logits), "sqrtsoftplus" (DeepSeek-V4's scores)
    renormalize: bool | None = None  # always (True), never (False) or as the config's ``norm_topk_prob`` (None)
    renormalize_default: bool = False  # when the config is silent
    weights_in_logits_dtype: bool = False  # round the weights to the logits' dtype (Qwen's reference does)
    logit_bias: bool = False  # ``gate.bias`` is added to the logits (gpt-oss)
    correction_bias: bool = False  # ``gate.e_score_correction_bias`` biases the choice, not the weights
    scores_fp32: bool = False  # the router's GEMM runs in fp32 whatever the model dtype; its tensors stay fp32
    grouped: bool = False  # reads ``n_group`` / ``topk_group`` (only the best groups' experts are eligible)
    scaled: bool = False  # reads ``routed_scaling_factor``
    hashed: bool = False  # a fixed expert list per token id (``gate.tid2eid``) chooses; the scores only weigh

    def routing(self, tc: dict[str, Any], num_experts: int) -> Routing:
        """This kind's settings from a text config, checked against the expert count."""
        renormalize = self.renormalize if self.renormalize is not None else \
            bool(tc.get("norm_topk_prob", self.renormalize_default))
        scaling = float(tc.get("routed_scaling_factor", 1.0) or 1.0) if self.scaled else 1.0
        n_group = int(tc.get("n_group") or 1) if self.grouped else 1
        topk_group = int(tc.get("topk_group") or 1) if self.grouped else 1
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ModelConfigError(f"{num_experts} experts do not split into n_group={n_group} groups with "
                                   f"topk_group={topk_group}")
        return Routing(renormalize, scaling, n_group, topk_group)

    def tensors(self) -> tuple[str, ...]:
        """The router's own tensors, by their name under ``mlp.gate``."""
        return (("weight",) + ("bias",) * self.logit_bias + ("e_score_correction_bias",) * self.correction_bias
                + ("tid2eid",) * self.hashed)

    def params(self, num_experts: int, hidden: int) -> int:
        """Parameters of one layer's router."""
        return num_experts * hidden + num_experts * (self.logit_bias + self.correction_bias)

    def describe(self, top_k: int, num_experts: int, routing: Routing) -> str:
        """Its line in ``strata ops``."""
        groups = f" ({routing.n_group} groups, best {routing.topk_group})" if routing.n_group > 1 else ""
        scale = f", scaling {routing.scaling:g}" if routing.scaling != 1.0 else ""
        renorm = ", renormalised" if routing.renormalize and self.method != "topk-softmax" else ""
        return f"top-{top_k} of {num_experts} experts, {self.name}{groups}{renorm}{scale}"


# Mixtral: softmax over every expert, top-k renormalised, the weights kept in fp32
SOFTMAX_MIXTRAL = RouterKind("softmax", "softmax", renormalize=True)
# Qwen3-MoE: renormalised as ``norm_topk_prob`` says, the weights rounded to the logits' dtype
SOFTMAX_QWEN = RouterKind("softmax", "softmax", weights_in_logits_dtype=True)
# Qwen3-VL-MoE: Qwen's, always renormalised whatever the config says
SOFTMAX_QWEN_VL = RouterKind("softmax", "softmax", renormalize=True, weights_in_logits_dtype=True)
# DeepSeek-V3, Kimi-K2, GLM-4.5: sigmoid scores, bias-corrected group-limited choice, scaled, fp32 GEMM
SIGMOID_GROUPED = RouterKind("sigmoid scores, bias-corrected group-limited choice", "sigmoid",
                             renormalize_default=True, correction_bias=True, scores_fp32=True, grouped=True,
                             scaled=True)
# MiniMax-M2: sigmoid scores, bias-corrected choice over every expert, always renormalised, GEMM in the
# model dtype (the bias sits on the MoE block in its checkpoints; the registry renames it onto the gate)
SIGMOID_TOPK = RouterKind("sigmoid scores, bias-corrected choice", "sigmoid", renormalize=True, correction_bias=True)
# gpt-oss: a router with a bias; softmax over the k best logits only
TOPK_SOFTMAX = RouterKind("softmax over the k best logits of a router with a bias", "topk-softmax", logit_bias=True)
# DeepSeek-V4: sqrt(softplus) scores, bias-corrected choice over every expert, renormalised, scaled
SQRTSOFTPLUS = RouterKind("sqrt-softplus scores, bias-corrected choice", "sqrtsoftplus", renormalize=True,
                          correction_bias=True, scaled=True)
# ... and its first layers: the experts fixed per token id (``tid2eid``), weighed by the same scores
HASH_SQRTSOFTPLUS = RouterKind("sqrt-softplus scores, experts fixed per token id (hash)", "sqrtsoftplus",
                               renormalize=True, scaled=True, hashed=True)

"""Per-stage autoscaling: each deployment scales on its own signal, not on request counts.

Replicas report their signal through ``record_autoscaling_stats()``; Serve averages it per
replica over ``look_back_period_s`` and calls the policy every control-loop tick. The policy
wants enough replicas for the total signal at ``target`` per replica (queued prompt tokens
for prefill, running sequences for decode, pending images for the encoder and preprocessor),
and decode also scales up while any replica's device KV tier is fuller than its target.
Serve then applies the up/down delays and the min/max bounds.
"""

from __future__ import annotations

import math
from typing import Any


class StageSignalPolicy:
    """Class-callable policy (Serve builds it once with ``policy_kwargs``; keeps no state of its own)."""

    def __init__(self, signal: str, target: float, occupancy_target: float | None = None, stage: str = "") -> None:
        if target <= 0:
            raise ValueError("target must be positive")
        self.stage = stage or signal
        self.signal = signal
        self.target = target
        self.occupancy_target = occupancy_target

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        try:
            return self._decide(ctx)
        except Exception as exc:  # never let a policy bug stall the controller: hold steady
            return ctx.target_num_replicas, {"error": repr(exc)}

    def _decide(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        per_replica = metrics.get(self.signal) or {}
        if not per_replica:  # no report yet (replicas starting): keep the current target
            return ctx.target_num_replicas, {}
        total = float(sum(per_replica.values()))
        want = math.ceil(total / self.target)
        if self.occupancy_target is not None:
            occupancy = max((metrics.get("kv_occupancy") or {}).values(), default=0.0)
            if occupancy > self.occupancy_target:
                want = max(want, ctx.current_num_replicas + 1)
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        decided = max(lo, min(hi, max(1, want)))
        _record_target(self.stage, decided)
        return decided, {"signal": total, "wanted": want}


def _record_target(stage: str, replicas: int) -> None:
    """Export the decision (the policy runs inside Serve's controller, a Ray actor)."""
    try:
        from strata.deployments.ray_serve.metrics import autoscaling_target

        autoscaling_target().set(float(replicas), tags={"stage": stage})
    except Exception:  # metrics must never break scaling
        pass

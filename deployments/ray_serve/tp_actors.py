"""Ranks 1.. of a tensor-parallel replica as Ray actors in the replica's own placement group.

A language-stage deployment with ``"tp": N`` reserves N bundles (``deployment_options``); its replica
runs in the first and is rank 0. It starts one :class:`TPWorker` actor per further bundle; each runs
``pipeline.tp_workers.run_worker`` until the replica tells it to stop. The actors are owned by the
replica, so Ray removes them with it, and the replica's health check fails once one of them died
(Serve then replaces the whole group).
"""

from __future__ import annotations

import ray
from ray.util import get_node_ip_address
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from strata.pipeline.core.tp_workers import WorkerSpec, run_worker

STOP_TIMEOUT_S = 10.0


@ray.remote(num_cpus=0)
class TPWorker:
    """One rank of a replica's group; ``run`` returns only when the driver says stop (or raises)."""

    def run(self, spec: str, rank: int) -> None:
        run_worker(WorkerSpec.from_json(spec), rank)


class RayWorkers:
    """The actors of ranks 1..size-1, each in its bundle of the current placement group."""

    def __init__(self, spec: WorkerSpec) -> None:
        group = get_current_placement_group()
        self.actors = []
        self.runs = []
        for rank in range(1, spec.size):
            strategy = (PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
                        if group is not None and rank < len(group.bundle_specs) else "DEFAULT")
            cpus = group.bundle_specs[rank].get("CPU", 0) if strategy != "DEFAULT" else 0  # type: ignore[union-attr]
            actor = TPWorker.options(num_cpus=cpus, scheduling_strategy=strategy, name=None).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(spec.to_json(), rank))

    def alive(self) -> bool:
        """False once any rank's ``run`` has returned or failed (a rank only leaves when told to)."""
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return not done

    def close(self) -> None:
        ray.wait(self.runs, num_returns=len(self.runs), timeout=STOP_TIMEOUT_S)
        for actor in self.actors:
            ray.kill(actor)


def group_host() -> str:
    """The address rank 0 listens on for the group: this node's IP (loopback on a local cluster)."""
    return get_node_ip_address()

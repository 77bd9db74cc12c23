"""The processes of a tensor-parallel stage besides the driver: what each runs, and a local launcher.

A worker joins the group, loads its shard (only its slices of the checkpoint), allocates its share
of the KV pool (same block count as the driver, its KV heads only) and serves the driver's commands.
:class:`LocalWorkers` starts ranks 1.. as child processes of this one (``strata generate --tp``,
in-process tests); ``deployments.ray_serve.tp_actors`` starts them as Ray actors in the replica's placement group.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol


from strata.kernels import get_attention_backend
from strata.kernels.threads import apply_threads
from strata.kvstore import KVLayout
from strata.kvstore.device_kv import DeviceKV
from strata.kvstore.layer_mirror import SpilledLayerMirror, mirror_bytes
from strata.kvstore.state_pool import StatePool
from strata.kvstore.window_slots import window_slot_counts
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.core.model_runner import StepExecutor
from strata.pipeline.core.tp_runner import serve_commands
from strata.pipeline.core.tp_states import StateShard
from strata.pipeline.models.cache_groups import kv_layout, mirrored_groups
from strata.pipeline.models.linear_mixer import state_kinds, state_slot_counts
from strata.pipeline.models.model_config import load_model_config
from strata.pipeline.models.model_loader import load_parallel_language_model, resolve_dtype, resolve_kv_dtype
from strata.pipeline.parallel.fault_points import set_fault_rank
from strata.pipeline.parallel.tp_group import GroupAddress, TPGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to join and load (picklable: it crosses to a child or an actor)."""

    model_dir: str
    config: dict[str, Any]  # EngineConfig.to_dict()
    address: GroupAddress
    size: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        d = json.loads(text)
        return cls(d["model_dir"], d["config"], GroupAddress(**d["address"]), d["size"])


class Workers(Protocol):
    """Ranks 1.. of a group, however they were started."""

    def alive(self) -> bool: ...

    def close(self) -> None: ...


Launcher = Callable[[WorkerSpec], Workers]


def run_worker(spec: WorkerSpec, rank: int) -> None:
    """Rank ``rank``'s whole life: join, load, serve commands until the driver says stop."""
    config = EngineConfig.from_dict(spec.config)
    apply_threads(config.num_threads, config.tp)
    set_fault_rank(rank)
    group = TPGroup.join(spec.address, rank, spec.size, config.device)
    try:
        cfg = load_model_config(spec.model_dir)
        dtype = resolve_dtype(config.dtype)
        model, stats = load_parallel_language_model(spec.model_dir, group, dtype, config.device, cfg)
        group.gather_object(stats)
        first_head, stop_head = model.plan.kv_heads
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, config.dtype)
        layout = kv_layout(cfg.text, config.block_size, kv_dtype)
        local = KVLayout(tuple(g.with_heads(stop_head - first_head) for g in layout.groups), layout.block_size)
        slots = window_slot_counts(layout, config.num_kv_blocks, config.max_num_seqs, config.max_num_batched_tokens)
        kv = DeviceKV(local, [slots.get(gi, config.num_kv_blocks) for gi in range(len(layout.groups))], config.device)
        backend = get_attention_backend(config.attention_backend, config.device, dtype, kv_dtype=kv_dtype)
        # sparse attention: the driver's budget for spilled blocks' copies (its decisions are followed: ``kvstore.layer_mirror``)
        mirrored = mirrored_groups(cfg.text)
        mirror = SpilledLayerMirror(mirror_bytes(layout, mirrored, config.max_model_len)) if mirrored else None
        states, shard = worker_states(config, cfg.text, model.plan, dtype)
        executor = StepExecutor(model, kv.layers, backend, config.block_size, config.device, layout.layer_meta,
                                states=states, layer_mirror=mirror)
        serve_commands(group, executor, kv, layout, first_head, config.kv_staging_blocks, shard)
    except Exception:
        log.exception("tensor-parallel rank %d stopped", rank)
        group.leave_on_error()  # the driver fails at once, even though this process (an actor) lives on
        raise
    finally:
        group.close()


def worker_states(config: EngineConfig, text: Any, plan: Any, dtype: Any) -> tuple[StatePool | None, StateShard | None]:
    """A linear-attention model's state slots on a worker (as many as the driver's, its heads' part of each) and
    which part that is; (None, None) for a model without linear layers."""
    if text.linear is None:
        return None, None
    running, snapshots = state_slot_counts(config)
    layers = sum(text.linear_layers)
    pool = StatePool(state_kinds(plan.local_config(), dtype), layers, running, config.device, snapshots)
    return pool, StateShard(state_kinds(text, dtype), layers, text.linear, plan.rank, plan.size)


class LocalWorkers:
    """Ranks 1..size-1 as child processes of this one (``python -m strata.pipeline.core.tp_workers``: a
    fresh interpreter, so nothing of this process - threads, a process group, ``__main__`` - leaks in)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-m", "strata.pipeline.core.tp_workers", str(rank)],
                                       stdin=subprocess.PIPE, text=True) for rank in range(1, spec.size)]
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(spec.to_json())
            p.stdin.close()

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def close(self, timeout_s: float = 10.0) -> None:
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_worker(WorkerSpec.from_json(sys.stdin.read()), int(sys.argv[1]))

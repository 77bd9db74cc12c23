"""Opening a tensor-parallel language stage: start the other ranks, join them, load this rank's shard.

The driver (this process, rank 0) picks the rendezvous address, asks a launcher for ranks 1..tp-1
(child processes by default; Ray actors under Serve), joins them, loads its own shard and collects
every rank's load statistics (bytes read: each rank reads only its slices).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.core.tp_workers import Launcher, LocalWorkers, Workers, WorkerSpec
from strata.pipeline.models.model_config import ModelConfig
from strata.pipeline.models.model_loader import check_tensor_parallel_split, load_parallel_language_model, resolve_dtype
from strata.pipeline.models.tensor_parallel import ParallelLanguageModel
from strata.pipeline.models.weights import LoadStats
from strata.pipeline.parallel.tp_group import GroupAddress, TPGroup

log = logging.getLogger(__name__)


@dataclass
class TPGroupHandle:
    """What the driver holds of its group: the group, the other ranks, its shard, the load statistics."""

    group: TPGroup
    workers: Workers
    model: ParallelLanguageModel
    load_stats: list[LoadStats]  # per rank, rank 0 first

    def close(self) -> None:
        self.workers.close()


MAX_SLOT_BYTES = 64 << 20


def shm_slot_bytes(config: EngineConfig, cfg: ModelConfig) -> int:
    """One rank's slot in the shared-memory channel: room for a full step's hidden states (fp32) or
    its logits shard; larger messages (rare) fall back to gloo."""
    t = cfg.text
    hidden = config.max_num_batched_tokens * t.hidden_size * 4
    logits = config.max_num_seqs * (-(-t.vocab_size // config.tp)) * 4
    return min(MAX_SLOT_BYTES, max(1 << 20, hidden, logits))


def open_group(model_dir: Path, config: EngineConfig, cfg: ModelConfig, launcher: Launcher | None = None,
               host: str = "127.0.0.1") -> TPGroupHandle:
    """Start and join ``config.tp`` ranks; raises (with the workers stopped) if they cannot form."""
    check_tensor_parallel_split(model_dir, cfg, config.tp)  # a model that does not split fails before anything starts
    address = GroupAddress.free_local(host, shm_slot_bytes(config, cfg))
    workers = (launcher or LocalWorkers)(WorkerSpec(str(model_dir), config.to_dict(), address, config.tp))
    try:
        group = TPGroup.join(address, 0, config.tp, config.device)
    except Exception as exc:
        workers.close()
        raise RuntimeError(f"the {config.tp - 1} tensor-parallel worker(s) did not join: {exc}") from exc
    try:
        model, stats = load_parallel_language_model(model_dir, group, resolve_dtype(config.dtype), config.device, cfg)
        everyone = group.gather_object(stats)
    except Exception:
        group.close()
        workers.close()
        raise
    assert everyone is not None
    log.info("tensor-parallel group of %d formed; weight bytes read per rank: %s", config.tp,
             [s.bytes_read for s in everyone])
    return TPGroupHandle(group, workers, model, everyone)

"""The device KV pool sized from a memory budget (``EngineConfig.kv_cache_memory``) instead of a block count.

A size ("4GiB") is the pool's bytes on this rank. A share ("40%") is of the memory still free once this
rank's weights are in: free memory now (CUDA: ``mem_get_info``; CPU: ``MemAvailable``) minus the bytes the
checkpoint's tensors take in the serving dtype, split over the tensor-parallel ranks. What the share leaves
is headroom for activations, the vision tower's work and everything else, as vLLM's
``--gpu-memory-utilization`` leaves it. The result is a ``num_kv_blocks``; a budget that holds no block
is an error that says how big a block is.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import torch

from strata.kvstore.layout import KVLayout
from strata.kvstore.window_slots import window_slot_counts
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.sizes import parse_budget
from strata.pipeline.models.linear_mixer import state_slot_counts
from strata.pipeline.parallel.linear_shards import LinearShards
from strata.pipeline.models.cache_groups import kv_layout
from strata.pipeline.models.model_loader import resolve_kv_dtype
from strata.pipeline.models.text_config import TextConfig

log = logging.getLogger(__name__)
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_dtype(config: EngineConfig) -> torch.dtype:
    """What the KV cache stores: the model's dtype, or e4m3 for ``kv_cache_dtype: fp8``."""
    return resolve_kv_dtype(config.kv_cache_dtype, config.dtype)


def with_kv_budget(config: EngineConfig, model_dir: Path, text: TextConfig) -> EngineConfig:
    """``config`` with ``num_kv_blocks`` from ``kv_cache_memory``, which is then spent (None): a config that
    crosses to other processes carries the count, not a budget each would measure anew. Unchanged
    without one."""
    if config.kv_cache_memory is None:
        return config
    layout = kv_layout(text, config.block_size, kv_dtype(config))
    rank_layout = layout.per_rank(config.tp)  # this rank's KV heads
    size, share = parse_budget(config.kv_cache_memory)
    if size is None:
        weights = checkpoint_elements(model_dir) * _ITEMSIZE[config.dtype] // config.tp
        size = int(max(0, free_memory(config.device) - weights) * share)
    per_block, windowed = _block_bytes(rank_layout, config)
    states = state_pool_bytes(text, config)
    blocks = (size - windowed - states) // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory {config.kv_cache_memory} holds no KV block: a block of "
                         f"{rank_layout.block_size} tokens takes {per_block} bytes here"
                         + (f", after {windowed} bytes of sliding-window slots" if windowed else "")
                         + (f", after {states} bytes of linear-attention state slots" if states else ""))
    log.info("KV pool: %d blocks (%d tokens, %.1f MiB) from kv_cache_memory %s", blocks,
             blocks * rank_layout.block_size, blocks * per_block / 2**20, config.kv_cache_memory)
    return config.model_copy(update={"num_kv_blocks": blocks, "kv_cache_memory": None})


def state_pool_bytes(text: TextConfig, config: EngineConfig) -> int:
    """What a rank's state slots take, whatever the KV pool's size (0 for a model without linear layers): under
    tensor parallelism its heads' part (``parallel.linear_shards``)."""
    if text.linear is None:
        return 0
    running, snapshots = state_slot_counts(config)
    lin = LinearShards(text.linear, 0, config.tp).local()
    return (running + snapshots) * sum(text.linear_layers) * lin.state_bytes(_ITEMSIZE[config.dtype])


def _block_bytes(layout: KVLayout, config: EngineConfig) -> tuple[int, int]:
    """(bytes a pool block costs, bytes the sliding-window groups' slots cost whatever the pool's size).
    A windowed group keeps a fixed number of slots (``window_slot_counts``), so only the full-attention
    groups grow with the pool; a model whose every layer slides is sized as if its groups were full."""
    group_bytes = [g.num_layers * g.layer_nbytes(layout.block_size) for g in layout.groups]
    if len(layout.window_groups) == len(layout.groups):
        return sum(group_bytes), 0
    slots = window_slot_counts(layout, 1 << 40, config.max_num_seqs, config.max_num_batched_tokens)
    windowed = sum(slots[gi] * group_bytes[gi] for gi in slots)
    return sum(b for gi, b in enumerate(group_bytes) if gi not in slots), windowed


def free_memory(device: str) -> int:
    """Bytes this process could still allocate on ``device``."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def checkpoint_elements(model_dir: Path) -> int:
    """Elements of every tensor in the checkpoint's safetensors shards, read from their headers alone."""
    total = 0
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with shard.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total

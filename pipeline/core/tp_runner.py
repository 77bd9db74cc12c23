"""Driver and worker halves of a tensor-parallel stage (the vLLM worker model).

Rank 0 (the driver) runs the scheduler, the KV tiers and the sampler. Before each collective the
other ranks must join, it broadcasts one command:

* ``("step", StepInputs)`` - run the forward on your shard (all-reduces inside, logits gathered);
* ``("read", rows)`` - send me your heads of a block (a block leaving the device for a tier);
* ``("write", rows)`` - take your heads of the block I broadcast (a block promoted from a tier);
* ``("state_read", (ops, slot))`` - replay my state changes, send me your part of a slot's state (``tp_states``);
* ``("stop", None)`` - leave the group.

When a step fails on any rank, the whole group abandons it (``TPGroup.abandon_step``): the driver
poisons the channel's next operation if its own forward raised, a worker does if its forward raised,
and every rank still inside the step raises :class:`StepAborted` at its next collective. The driver
then raises the step's failure to its engine core (which retries the chunks one by one, each a fresh
step of a group that is in step again); workers go back to waiting for the next command. No rank ever
pairs one step's collective with another's.

Every rank holds the same block ids and windowed slots (the driver allocates and lends; commands and
steps carry each group's row), each with only its own KV heads, so tier files, hashes and handles always describe whole blocks. Spilled blocks stream
into attention the same way: the driver reads a segment's layer from the tier files and broadcasts
it; each rank keeps its heads.
"""

from __future__ import annotations

import logging

import torch

from strata.kernels import AttentionBackend, SpilledKV
from strata.kvstore import BlockPool, BlockTable, DeviceBlocks, KVBlockLostError, KVLayout, TieredKVCache
from strata.kvstore.device_kv import DeviceKV, join_block, split_block
from strata.kvstore.state_pool import StatePool
from strata.pipeline.core.model_runner import ModelRunner, StepExecutor
from strata.pipeline.core.scheduler import ScheduledChunk
from strata.pipeline.core.tp_states import ShardedStatePool, StateShard, replay, serve_state_read
from strata.pipeline.models.decoder import LanguageModel
from strata.pipeline.models.kv_scales import calibration_amax, scales_from_amax, set_kv_scales
from strata.pipeline.parallel.fault_points import fault_point
from strata.pipeline.parallel.shm_channel import ChannelDesyncError, PeerDiedError, StepAborted
from strata.pipeline.parallel.tp_group import TPGroup

log = logging.getLogger(__name__)
HEADS = -2  # the KV-head dimension of a block's group tensor (layers, kv_parts, block_size, heads, head_dim)


class ShardedDeviceBlocks(DeviceBlocks):
    """Whole-block reads and writes of a pool whose heads are spread over the group (driver side).
    ``kv_replicas`` ranks in a row hold the same KV heads when tp exceeds them; a read takes one."""

    def __init__(self, pool: BlockPool, group: TPGroup, layout: KVLayout, kv_replicas: int = 1) -> None:
        super().__init__(pool)
        self.group = group
        self.layout = layout  # the whole block's (every rank's heads)
        self.kv_replicas = kv_replicas

    def read(self, block_id: int) -> torch.Tensor:
        rows = self.pool.storage_ids(block_id)  # the driver lends windowed slots; workers hold the same rows
        if min(rows) < 0:  # refused here, before any rank is told: a part that is gone has no bytes to gather
            raise ValueError("a part of this block is not on the device")
        self.group.broadcast_object(("read", rows))
        whole = []
        for part in self.pool.kv.block(rows):  # every group, in order
            heads = self.group.gather_to_driver(part)
            assert heads is not None
            whole.append(torch.cat(heads[:: self.kv_replicas], dim=HEADS))
        return join_block(whole)

    def write(self, block_id: int, block: torch.Tensor) -> None:
        rows = self.pool.storage_ids(block_id)
        self.group.broadcast_object(("write", rows))
        full = self.group.broadcast(block.to(self.pool.kv.device).contiguous())
        _write_my_heads(self.pool.kv, self.layout, rows, full, 0)


def _my_heads(block: torch.Tensor, first_head: int, local_heads: int) -> torch.Tensor:
    return block.narrow(HEADS, first_head, local_heads)


def _write_my_heads(kv: DeviceKV, layout: KVLayout, rows: list[int], full: torch.Tensor, first_head: int) -> None:
    """Take this rank's heads of every group of a whole block's bytes (``full``, uint8, any device) into
    each group's row (``BlockPool.storage_ids``)."""
    parts = split_block(layout, full)
    kv.write(rows, [_my_heads(p, first_head, t.shape[HEADS]) for p, t in zip(parts, kv.groups)])


class _ShardedSpilled:
    """A sequence's spilled blocks as one rank's attention reads them: its heads of each segment."""

    def __init__(self, group: TPGroup, local_kv: DeviceKV, full_heads: int, first_head: int, num_blocks: int,
                 segment_blocks: int) -> None:
        self.group = group
        self.first_head = first_head  # this rank's first KV head
        self.local_kv = local_kv  # this rank's heads of every group
        self.full_heads = full_heads
        self.num_blocks = num_blocks
        self.segment_blocks = segment_blocks

    def _segment_shape(self, layer: int, count: int) -> tuple[int, ...]:
        _, parts, bs, _, d = self.local_kv.layers[layer].shape
        return (count, parts, bs, self.full_heads, d)

    def _assemble(self, layer: int, n: int, on_device: dict[int, int], from_tier: torch.Tensor):
        local = self.local_kv.layers[layer]  # [blocks, kv_parts, block_size, local heads, head_dim]
        heads = local.shape[HEADS]
        out = torch.empty(n, *local.shape[1:], dtype=local.dtype, device=local.device)
        tier_rows = [i for i in range(n) if i not in on_device]
        for j, i in enumerate(tier_rows):
            out[i] = _my_heads(from_tier[j], self.first_head, heads)
        for i, block_id in on_device.items():
            out[i] = local[block_id]
        return out[:, 0], out[:, -1]


class DriverSpilled(_ShardedSpilled):
    def __init__(self, cache: TieredKVCache, table: BlockTable, group: TPGroup, segment_blocks: int) -> None:
        super().__init__(group, cache.pool.kv, _full_heads(cache.layout), 0, table.num_spilled, segment_blocks)
        self.cache = cache
        self.hashes = list(table.hashes[: table.num_spilled])
        self.block_size = cache.layout.block_size

    def agree(self, decision: object) -> object:
        """Tell every rank what this rank decided about these blocks (``kvstore.layer_mirror``)."""
        return self.group.broadcast_object(decision)

    def load(self, layer: int, first_block: int, num_blocks: int):
        hashes = self.hashes[first_block : first_block + num_blocks]
        found = {i: self.cache.pool.lookup(h) for i, h in enumerate(hashes)}
        on_device = {i: b for i, b in found.items() if b is not None}
        tier = [h for i, h in enumerate(hashes) if i not in on_device]
        from_tier = torch.empty(self._segment_shape(layer, len(tier)), dtype=self.local_kv.layers[layer].dtype)
        lost = next((h for j, h in enumerate(tier) if not self._read(h, from_tier[j], layer)), None)
        self.group.broadcast_object((lost is not None, on_device, len(tier)))
        if lost is not None:
            raise KVBlockLostError(lost)
        if tier:
            self.group.broadcast(from_tier)
        return self._assemble(layer, len(hashes), on_device, from_tier.to(self.local_kv.device))

    def _read(self, block_hash: bytes, out: torch.Tensor, layer: int) -> bool:
        lower = self.cache.lower
        slot = self.cache.layout.slot_of(layer)
        return lower is not None and lower.read_layers(block_hash, out.reshape(-1).view(torch.uint8).numpy(), slot, 1)


def _full_heads(layout: KVLayout) -> int:
    """The KV heads every group of a tensor-parallel layout has (the shard plan splits one head count)."""
    heads = {g.num_kv_heads for g in layout.groups}
    if len(heads) != 1:
        raise ValueError(f"tensor parallelism needs one KV head count in every cache group, got {sorted(heads)}")
    return heads.pop()


class WorkerSpilled(_ShardedSpilled):
    def agree(self, decision: object) -> object:
        """What the driver decided about these blocks (this rank knows no block hashes)."""
        return self.group.broadcast_object(None)

    def load(self, layer: int, first_block: int, num_blocks: int):
        lost, on_device, count = self.group.broadcast_object(None)
        if lost:
            raise KVBlockLostError(b"")
        from_tier = torch.empty(self._segment_shape(layer, count), dtype=self.local_kv.layers[layer].dtype)
        if count:
            self.group.broadcast(from_tier)
        return self._assemble(layer, num_blocks, on_device, from_tier.to(self.local_kv.device))


class TPModelRunner(ModelRunner):
    """The driver's runner: broadcasts each step's inputs, then runs its own shard of it."""

    def __init__(self, model: LanguageModel, kv: TieredKVCache, backend: AttentionBackend, group: TPGroup,
                 device: str = "cpu") -> None:
        super().__init__(model, kv, backend, device)
        self.group = group
        self.load_stats: list = []  # each rank's LoadStats (bytes read), set by whoever formed the group

    @property
    def tp_size(self) -> int:
        return self.group.size

    @property
    def states_pool(self) -> StatePool | None:
        return self.kv.states.pool if self.kv.states is not None else None

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        inputs = self.prepare(chunks)
        self.group.check_usable()
        if isinstance(self.states_pool, ShardedStatePool):  # what the workers' slots must catch up on first
            inputs.state_ops = self.states_pool.take_ops()
        self.group.broadcast_object(("step", inputs))
        self.group.step_started()
        try:
            spilled = [self.spilled_source(c.seq.block_table) if n else None
                       for c, n in zip(chunks, inputs.num_spilled)]
            logits = self._run(chunks, inputs, spilled)
        except KVBlockLostError:  # every rank gave the step up at the same operation
            raise
        except StepAborted:  # a worker's forward failed; the whole group gave the step up with it
            self.group.abandoned_steps += 1
            raise
        except (PeerDiedError, ChannelDesyncError, TimeoutError) as exc:
            self.group.mark_broken(type(exc).__name__)
            raise
        except Exception as exc:  # this rank's forward raised mid-step: the workers must drop it too
            if not self.group.abandon_step(type(exc).__name__):
                log.error("tensor-parallel group broken: %s", self.group.broken)
            raise
        assert logits is not None
        return logits

    def spilled_source(self, table: BlockTable) -> SpilledKV | None:
        return DriverSpilled(self.kv, table, self.group, self.kv.staging_blocks) if table.num_spilled else None

    def close(self) -> None:
        """Tell the workers to leave, and leave the group (a group that lost a rank is just left)."""
        try:
            self.group.broadcast_object(("stop", None))
        except Exception:  # a worker died: the others stop when their sockets close
            log.warning("tensor-parallel group was already broken at shutdown")
        try:
            self.group.close()
        except Exception:
            log.warning("tensor-parallel group did not close cleanly")


def serve_commands(group: TPGroup, executor: StepExecutor, kv: DeviceKV, layout: KVLayout, first_head: int,
                   segment_blocks: int, state_shard: StateShard | None = None) -> None:
    """A worker's life after loading: run the driver's commands until it says stop.

    A lost spilled block fails the step on every rank alike (the driver recomputes); a forward that
    raises here is abandoned by the whole group and this rank waits for the next command. Anything
    else (a dead or out-of-step peer, a broken command) leaves the loop; the caller then marks this
    rank gone, so the driver's next collective fails at once instead of waiting for its timeout.
    """
    full_heads = _full_heads(layout)  # ``layout``: the whole block's; ``kv``: this rank's heads of it
    while True:
        try:
            command, arg = group.broadcast_object(None, idle=True)
        except StepAborted:  # the driver gave up a step this rank had already finished
            continue
        fault_point("tp_command", group.rank)
        if command == "stop":
            return
        if command == "step":
            group.step_started()
            if arg.state_ops:  # the driver's state changes since the last step, before this one reads any
                assert executor.states is not None and state_shard is not None
                replay(executor.states, state_shard, arg.state_ops)
            spilled: list[SpilledKV | None] = [
                WorkerSpilled(group, kv, full_heads, first_head, n, segment_blocks) if n else None
                for n in arg.num_spilled]
            try:
                executor.run(arg, spilled)
            except (KVBlockLostError, StepAborted):  # the whole group gave this step up
                continue
            except (PeerDiedError, ChannelDesyncError, TimeoutError):
                raise
            except Exception:  # this rank's forward raised: the group abandons the step, this rank stays
                log.exception("tensor-parallel rank %d: step failed", group.rank)
                if not group.abandon_step("a worker's forward raised"):
                    raise
                continue
        elif command == "state_read":
            assert executor.states is not None and state_shard is not None
            serve_state_read(group, executor.states, state_shard, arg)
        elif command == "kv_calibrate":
            calibrate_rank(group, executor.model, arg, executor.block_size, executor.backend, executor.device)
        elif command == "kv_scales":
            set_kv_scales(executor.model, arg)
        elif command == "read":
            for part in kv.block(arg):
                group.gather_to_driver(part)
        elif command == "write":
            full = group.broadcast(torch.empty(layout.bytes_per_block(), dtype=torch.uint8, device=kv.device))
            _write_my_heads(kv, layout, arg, full, first_head)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {command!r}")


def calibrate_group(group: TPGroup, model: LanguageModel, token_ids: list[int], block_size: int,
                    backend: AttentionBackend, device: str | torch.device) -> list[tuple[float, float]]:
    """The driver's side of an FP8 cache's calibration (``kv_scales``): every rank runs the pass on the same
    tokens, the driver takes the largest amax of each layer over the ranks' heads, and every rank gets the
    same scales (those one process over all heads would get)."""
    group.broadcast_object(("kv_calibrate", token_ids))
    return calibrate_rank(group, model, token_ids, block_size, backend, device)


def share_kv_scales(group: TPGroup, model: LanguageModel, scales: list[tuple[float, float]]) -> None:
    """Every rank of the group takes ``scales`` (known already: another process calibrated this model)."""
    group.broadcast_object(("kv_scales", scales))
    set_kv_scales(model, scales)


def calibrate_rank(group: TPGroup, model: LanguageModel, token_ids: list[int], block_size: int,
                   backend: AttentionBackend, device: str | torch.device) -> list[tuple[float, float]]:
    amax = calibration_amax(model, token_ids, block_size, backend, device)
    parts = group.gather_to_driver(amax)
    scales = scales_from_amax(torch.stack(parts).amax(0)) if parts is not None else None
    scales = group.broadcast_object(scales)
    set_kv_scales(model, scales)
    return scales

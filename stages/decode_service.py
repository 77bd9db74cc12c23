"""The decode stage as a service: every admitted sequence of this replica decodes in one batch.

Used by the Ray ``Decode`` deployment and testable without Ray. A caller streams lists of
token events for its request; closing the stream early (client gone) aborts the sequence
and frees its blocks.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

import torch

from strata.pipeline.contract.handoff import Handoff
from strata.pipeline.contract.request import TokenEvent
from strata.pipeline.core.engine_core import speculation_stats
from strata.pipeline.core.sequence import Sequence
from strata.stages.decoder import Decoder
from strata.stages.kv_transfer import KVPuller
from strata.stages.stage_loop import Delivery, StageLoop


class DecodeService:
    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.block_size = decoder.kv.layout.block_size
        self.delivery = Delivery()
        self.loop = StageLoop(self._step, decoder.has_work, name="decode-loop", on_error=self._fail_all)
        self.puller: KVPuller | None = None  # set where prefill may run on another node (stages.kv_transfer)
        self.on_close: Callable[[], None] | None = None  # e.g. stop a tensor-parallel group's workers
        self.healthy: Callable[[], bool] = lambda: True  # False once a tensor-parallel worker died

    def _fail_all(self, exc: BaseException) -> None:
        """A step failed outside any one request: end every stream with an error, free their KV."""
        sched = self.decoder.scheduler
        for seq in [*sched.running, *sched.waiting]:  # free first: a caller told of the failure finds its KV gone
            self.decoder.abort(seq)
        self.delivery.send_all(lambda rid: TokenEvent.failure(rid, "an internal error stopped this request"))

    def _step(self) -> None:
        self.delivery.send_many([(event.request_id, event) for event in self.decoder.step()])

    async def generate(self, handoff: Handoff) -> AsyncIterator[list[TokenEvent]]:
        """Admit a prefilled sequence and yield its new token events, a batch per wake-up."""
        seq = Sequence.from_handoff(handoff, self.block_size)
        events = self.delivery.open(seq.request_id)
        finished = False
        try:
            if self.puller is not None and self.puller.needs_pull(handoff):
                await self.puller.pull(handoff)  # blocks missing here come from the prefill's node first
            await self.loop.run(lambda: self.decoder.admit(seq, handoff.kv_handle, handoff.tail_kv,
                                                           handoff.linear_state))
            while not finished:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                finished = batch[-1].finished
                yield batch
        finally:
            self.delivery.close(seq.request_id)
            if not finished:  # cancelled or the consumer went away: free the sequence's blocks
                self.loop.call(lambda: self.decoder.abort(seq))

    async def stats(self) -> dict[str, Any]:
        return await self.loop.run(self._stats)

    def _stats(self) -> dict[str, Any]:
        kv = self.decoder.kv
        pool = kv.pool.stats()
        return {"running": self.decoder.num_running, "kv_occupancy": pool["in_use"] / pool["total"], "kv": kv.stats(),
                "preemptions": self.decoder.scheduler.num_preemptions, "handoff_tokens": dict(self.decoder.handoff_tokens),
                "handoff_other_scales_tokens": self.decoder.other_scales_tokens,
                "kv_transfer_blocks": dict(self.puller.counts) if self.puller is not None else {},
                "tp": self.decoder.core.runner.tp_size, "threads": torch.get_num_threads(),
                **speculation_stats(self.decoder.core)}

    def close(self) -> None:
        self.loop.stop()
        if self.on_close is not None:  # after the loop: no step is mid-collective
            self.on_close()

"""The prefill stage as a service: asyncio callers hand in requests, one thread steps them all.

Used by the Ray ``Prefill`` deployment and testable without Ray. Every queued prompt shares
the step loop's chunked-prefill batches; a caller gets back a :class:`Handoff` (prefill's token
event, the sequence state and the KV handle) to pass on to a decode replica.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import torch

from strata.pipeline.contract.handoff import Handoff
from strata.pipeline.contract.request import Request
from strata.pipeline.core.sequence import Sequence
from strata.stages.prefiller import Prefiller
from strata.stages.stage_loop import Delivery, StageLoop


class StageFailed(RuntimeError):
    """The stage could not complete the request; the message is fit for the client."""


class PrefillService:
    def __init__(self, prefiller: Prefiller) -> None:
        self.prefiller = prefiller
        self.block_size = prefiller.kv.layout.block_size
        self.delivery = Delivery()
        self.loop = StageLoop(self._step, prefiller.has_work, name="prefill-loop", on_error=self._fail_all)
        self.on_close: Callable[[], None] | None = None  # e.g. stop a tensor-parallel group's workers
        self.healthy: Callable[[], bool] = lambda: True  # False once a tensor-parallel worker died

    def _fail_all(self, exc: BaseException) -> None:
        """A step failed outside any one request: every waiting caller gets an error, KV is freed."""
        sched = self.prefiller.scheduler
        for seq in [*sched.running, *sched.waiting]:  # free first: a caller told of the failure finds its KV gone
            self.prefiller.abort(seq)
        self.delivery.send_all(lambda rid: StageFailed("an internal error stopped this request"))

    def _step(self) -> None:
        for result in self.prefiller.step():
            self.delivery.send(result.seq.request_id, result)

    async def prefill(self, request: Request) -> Handoff:
        """Prefill one request; cancelling the caller aborts it and frees its blocks. When the first
        token already finishes the request the hand-off's ``kv_handle`` is empty."""
        seq = Sequence.from_request(request, self.block_size)
        results = self.delivery.open(seq.request_id)
        try:
            await self.loop.run(lambda: self.prefiller.add(seq))
            result = await results.get()
            if isinstance(result, StageFailed):
                raise result
        except asyncio.CancelledError:
            self.loop.call(lambda: self.prefiller.abort(seq))
            raise
        finally:
            self.delivery.close(seq.request_id)
        return result.seq.to_handoff(result.event, result.kv_handle, result.tail_kv, result.linear_state)

    async def stats(self) -> dict[str, Any]:
        """KV store and queue figures, read on the loop thread (consistent with the scheduler)."""
        return await self.loop.run(self._stats)

    def _stats(self) -> dict[str, Any]:
        return {"queued_prompt_tokens": self.prefiller.num_queued_tokens, "kv": self.prefiller.kv.stats(),
                "waiting": len(self.prefiller.scheduler.waiting),
                "preemptions": self.prefiller.scheduler.num_preemptions, "tp": self.prefiller.core.runner.tp_size,
                "threads": torch.get_num_threads()}

    def close(self) -> None:
        self.loop.stop()
        if self.on_close is not None:  # after the loop: no step is mid-collective
            self.on_close()

"""The in-process engine as a service: prefill and decode of one replica in one step loop, one KV pool.

This is the aggregated serving mode: asyncio callers hand in requests that went through intake; one
thread steps the engine (decodes first, then prefill chunks in the rest of the step's budget) and
delivers each step's token events to the callers' loops. No hand-off leaves the process: a prefilled
sequence's blocks are already where decode reads them. Closing a stream early aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from strata.pipeline.contract.request import Request, TokenEvent
from strata.pipeline.core.engine import Engine
from strata.stages.stage_loop import Delivery, StageLoop

log = logging.getLogger(__name__)


class EngineService:
    def __init__(self, engine: Engine, stream_interval_s: float = 0.0) -> None:
        """``stream_interval_s``: after a request's first token, gather its events for up to this long
        before handing them on (fewer, larger writes per stream at high concurrency; 0 = every wake-up)."""
        self.engine = engine
        self.stream_interval_s = stream_interval_s
        self.delivery = Delivery()
        self.loop = StageLoop(self._step, engine.has_unfinished, name="engine-loop", on_error=self._fail_all)

    def _fail_all(self, exc: BaseException) -> None:
        """A step failed outside any one request: end every request with an error, free their KV."""
        for rid in list(self.engine._requests):  # free first: a caller told of the failure finds its KV gone
            self.engine.abort(rid)
        self.delivery.send_all(lambda rid: [TokenEvent.failure(rid, "an internal error stopped this request")])

    def _step(self) -> None:
        by_request: dict[str, list[TokenEvent]] = {}
        for event in self.engine.step():
            by_request.setdefault(event.request_id, []).append(event)
        self.delivery.send_many(list(by_request.items()))  # one hand-off to the event loop per step

    async def generate(self, request: Request) -> AsyncIterator[list[TokenEvent]]:
        """Queue the request and yield its token events, the events of one or more steps per batch."""
        rid = request.request_id
        queue = self.delivery.open(rid)
        finished = False
        try:
            await self.loop.run(lambda: self.engine.add(request))
            first = True
            while not finished:
                batch = list(await queue.get())
                if self.stream_interval_s and not first and not batch[-1].finished:
                    await asyncio.sleep(self.stream_interval_s)  # bounded: at most one interval per batch
                while not queue.empty():
                    batch.extend(queue.get_nowait())
                finished = batch[-1].finished
                first = False
                yield batch
        finally:
            self.delivery.close(rid)
            if not finished:  # cancelled or the consumer went away: free the sequence's blocks
                log.debug("request %s: aborted by its caller", rid)
                self.loop.call(lambda: self.engine.abort(rid))

    async def stats(self) -> dict[str, Any]:
        return await self.loop.run(self._stats)

    def _stats(self) -> dict[str, Any]:
        kv = self.engine.prefiller.kv
        pool = kv.pool.stats()
        return {"running": self.engine.num_running, "queued_prompt_tokens": self.engine.num_queued_prompt_tokens(),
                "kv_occupancy": pool["in_use"] / pool["total"], "kv": kv.stats(),
                "preemptions": self.engine.prefiller.scheduler.num_preemptions + self.engine.decoder.scheduler.num_preemptions,
                "tp": self.engine.prefiller.core.runner.tp_size}

    def close(self) -> None:
        self.loop.stop()
        self.engine.close()

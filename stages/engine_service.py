"""The in-process engine as a service: prefill and decode of one replica in one step loop, one KV pool.

This is the aggregated serving mode: asyncio callers hand in requests that went through intake; one
thread steps the engine (one forward per step: every decode, then prefill chunks in the rest of the
step's token budget) and delivers each step's token events to the callers' loops. No hand-off leaves
the process: a prefilled sequence's blocks are already where decode reads them. Closing a stream
early aborts the request. (``engine_process`` runs the same engine in a process of its own.)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import torch

from strata.pipeline.contract.request import Request, TokenEvent
from strata.pipeline.core.engine import Engine
from strata.pipeline.core.engine_core import speculation_stats
from strata.stages.stage_loop import Delivery, StageLoop

log = logging.getLogger(__name__)
INTERNAL_ERROR = "an internal error stopped this request"


def engine_stats(engine: Engine) -> dict[str, Any]:
    """KV, queue and scheduler figures of an engine (read on the thread that steps it)."""
    kv = engine.kv
    pool = kv.pool.stats()
    return {"running": engine.num_running, "waiting": len(engine.scheduler.waiting),
            "queued_prompt_tokens": engine.num_queued_prompt_tokens(),
            "kv_occupancy": pool["in_use"] / pool["total"], "kv": kv.stats(),
            "preemptions": engine.scheduler.num_preemptions, "tp": engine.core.runner.tp_size,
            "threads": torch.get_num_threads(), "step_totals": dict(engine.step_totals),
            "recent_steps": [list(step) for step in engine.recent_steps],
            **speculation_stats(engine.core)}


class EngineStreams:
    """What an aggregated replica's front end sees of its engine, wherever the engine steps: queue a
    request, stream its token events, abort it when the stream closes early. Subclasses say how a
    request reaches the engine (:meth:`_submit`, :meth:`_abort`) and deliver events to ``delivery``."""

    def __init__(self, stream_interval_s: float = 0.0) -> None:
        """``stream_interval_s``: after a request's first token, gather its events for up to this long
        before handing them on (fewer, larger writes per stream at high concurrency; 0 = every wake-up)."""
        self.stream_interval_s = stream_interval_s
        self.delivery = Delivery()

    def _deliver(self, events: list[TokenEvent]) -> None:
        """One step's events to their requests' streams, with one wake-up per event loop."""
        by_request: dict[str, list[TokenEvent]] = {}
        for event in events:
            by_request.setdefault(event.request_id, []).append(event)
        self.delivery.send_many(list(by_request.items()))

    async def _submit(self, request: Request) -> None:
        raise NotImplementedError

    def _abort(self, request_id: str) -> None:
        raise NotImplementedError

    async def generate(self, request: Request) -> AsyncIterator[list[TokenEvent]]:
        """Queue the request and yield its token events, the events of one or more steps per batch."""
        rid = request.request_id
        queue = self.delivery.open(rid)
        finished = False
        try:
            await self._submit(request)
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
                self._abort(rid)


class EngineService(EngineStreams):
    def __init__(self, engine: Engine, stream_interval_s: float = 0.0) -> None:
        super().__init__(stream_interval_s)
        self.engine = engine
        self.loop = StageLoop(self._step, engine.has_unfinished, name="engine-loop", on_error=self._fail_all)

    def _fail_all(self, exc: BaseException) -> None:
        """A step failed outside any one request: end every request with an error, free their KV."""
        for rid in list(self.engine._requests):  # free first: a caller told of the failure finds its KV gone
            self.engine.abort(rid)
        self.delivery.send_all(lambda rid: [TokenEvent.failure(rid, INTERNAL_ERROR)])

    def _step(self) -> None:
        self._deliver(self.engine.step())

    async def _submit(self, request: Request) -> None:
        await self.loop.run(lambda: self.engine.add(request))

    def _abort(self, request_id: str) -> None:
        self.loop.call(lambda: self.engine.abort(request_id))

    def healthy(self) -> bool:
        return self.engine.healthy()

    async def stats(self) -> dict[str, Any]:
        return await self.loop.run(lambda: engine_stats(self.engine))

    def close(self) -> None:
        self.loop.stop()
        self.engine.close()

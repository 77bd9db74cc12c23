"""The prefill stage as a service: asyncio callers hand in sequences, one thread steps them all.

Used by the Ray ``Prefill`` deployment and testable without Ray. Every queued prompt shares
the step loop's chunked-prefill batches; a caller gets the first token, the KV handle and
the sequence state to pass on to a decode replica.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.sequence_wire import sequence_from_wire, sequence_to_wire
from stages.prefiller import Prefiller
from stages.stage_loop import Delivery, StageLoop


class PrefillService:
    def __init__(self, prefiller: Prefiller) -> None:
        self.prefiller = prefiller
        self.block_size = prefiller.pool.layout.block_size
        self.delivery = Delivery()
        self.loop = StageLoop(self._step, prefiller.has_work, name="prefill-loop")

    def _step(self) -> None:
        for result in self.prefiller.step():
            self.delivery.send(result.seq.seq_id, result)

    async def prefill(self, wire: dict[str, Any]) -> dict[str, Any]:
        """Prefill one sequence; cancelling the caller aborts it and frees its blocks."""
        seq = sequence_from_wire(wire, self.block_size)
        results = self.delivery.open(seq.seq_id)
        try:
            await self.loop.run(lambda: self.prefiller.add(seq))
            result = await results.get()
        except asyncio.CancelledError:
            self.loop.call(lambda: self.prefiller.abort(seq))
            raise
        finally:
            self.delivery.close(seq.seq_id)
        first = result.first
        return {
            "token_id": first.token_id,
            "text_delta": first.text_delta,
            "finished": first.finished,
            "finish_reason": seq.finish_reason,
            "handle": result.handle,
            "seq": sequence_to_wire(seq),
            "num_cached_tokens": seq.num_cached_tokens,
        }

    async def stats(self) -> dict[str, Any]:
        """KV store and queue figures, read on the loop thread (consistent with the scheduler)."""
        return await self.loop.run(self._stats)

    def _stats(self) -> dict[str, Any]:
        kv = self.prefiller.core.runner.kv.stats()
        return {"queued_prompt_tokens": self.prefiller.num_queued_tokens, "kv": kv,
                "preemptions": self.prefiller.scheduler.num_preemptions}

    def close(self) -> None:
        self.loop.stop()

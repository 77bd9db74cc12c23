"""The decode stage as a service: every admitted sequence of this replica decodes in one batch.

Used by the Ray ``Decode`` deployment and testable without Ray. A caller streams lists of
token events for its sequence; closing the stream early (client gone) aborts the sequence
and frees its blocks.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from pipeline.sequence_wire import sequence_from_wire
from stages.decoder import Decoder
from stages.stage_loop import Delivery, StageLoop


class DecodeService:
    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.block_size = decoder.pool.layout.block_size
        self.delivery = Delivery()
        self.loop = StageLoop(self._step, decoder.has_work, name="decode-loop")

    def _step(self) -> None:
        for ev in self.decoder.step():
            seq = ev.seq
            self.delivery.send(seq.seq_id, {
                "token_id": ev.token_id, "text_delta": ev.text_delta, "finished": ev.finished,
                "finish_reason": seq.finish_reason if ev.finished else None,
            })

    async def generate(self, wire: dict[str, Any], handle: bytes) -> AsyncIterator[list[dict[str, Any]]]:
        """Admit a prefilled sequence and yield its new token events, a batch per wake-up."""
        seq = sequence_from_wire(wire, self.block_size)
        events = self.delivery.open(seq.seq_id)
        finished = False
        try:
            await self.loop.run(lambda: self.decoder.admit(seq, handle))
            while not finished:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                finished = batch[-1]["finished"]
                yield batch
        finally:
            self.delivery.close(seq.seq_id)
            if not finished:  # cancelled or the consumer went away: free the sequence's blocks
                self.loop.call(lambda: self.decoder.abort(seq))

    async def stats(self) -> dict[str, Any]:
        return await self.loop.run(self._stats)

    def _stats(self) -> dict[str, Any]:
        kv = self.decoder.core.runner.kv
        pool = kv.pool.stats()
        return {"running": self.decoder.num_running, "kv_occupancy": pool["in_use"] / pool["total"], "kv": kv.stats(),
                "preemptions": self.decoder.scheduler.num_preemptions}

    def close(self) -> None:
        self.loop.stop()

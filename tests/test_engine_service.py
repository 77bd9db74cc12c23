"""The aggregated mode's engine service (prefill and decode in one step loop, one pool), driven from
asyncio as the LLM deployment drives it, before any Ray is involved."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from helpers import build, greedy
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.stages.engine_service import EngineService

PROMPTS = ["Tell me about the tides and the moon. " * 6, "A short one.", "Why is the sea salty? " * 3]


@pytest.fixture(scope="module")
def engine(llama_dir: Path):
    return build(llama_dir)


async def _collect(service: EngineService, request) -> tuple[list[int], str, str | None]:
    tokens, text, reason = [], "", None
    async for batch in service.generate(request):
        tokens += [e.token_id for e in batch]
        text += "".join(e.text_delta for e in batch)
        reason = batch[-1].finish_reason
    return tokens, text, reason


@pytest.mark.parametrize("interval", [0.0, 0.005], ids=["every-step", "coalesced"])
def test_concurrent_streams_equal_the_in_process_engine(engine, llama_dir: Path, interval: float) -> None:
    params = [greedy(12), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7), greedy(12, stop=["e"])]
    expected = build(llama_dir).generate([{"prompt": p, "params": sp} for p, sp in zip(PROMPTS, params)])
    service = EngineService(engine, interval)
    try:
        async def main():
            requests = [engine.intake.make_request(f"svc-{interval}-{i}", sp, prompt=p)[0]
                        for i, (p, sp) in enumerate(zip(PROMPTS, params))]
            return await asyncio.gather(*(_collect(service, r) for r in requests))

        for (tokens, text, reason), exp in zip(asyncio.run(main()), expected):
            assert tokens == exp.output_token_ids and text == exp.text and reason == exp.finish_reason
    finally:
        service.close()


def test_closing_a_stream_early_frees_its_blocks(engine) -> None:
    service = EngineService(engine)
    pool = engine.kv.pool
    try:
        async def main() -> dict:
            baseline = pool.stats()["in_use"]
            request = engine.intake.make_request("gone", SamplingParams(max_tokens=500, temperature=0, ignore_eos=True),
                                                 prompt=PROMPTS[0])[0]
            stream = service.generate(request)
            await stream.__anext__()
            assert (await service.stats())["running"] == 1
            await stream.aclose()  # what a client disconnect does
            for _ in range(200):
                stats = await service.stats()
                if stats["running"] == 0 and pool.stats()["in_use"] == baseline:
                    return stats
                await asyncio.sleep(0.01)
            raise AssertionError(f"blocks not released: {pool.stats()}")

        asyncio.run(main())
        assert not engine.has_unfinished()
    finally:
        service.close()

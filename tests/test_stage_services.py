"""Prefill and decode as separate services (own models, own pools, KV through the host tier),
driven from asyncio the way the Ray deployments drive them — before any Ray is involved."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from strata.kvstore import KVHandle
from strata.pipeline.config import EngineConfig
from strata.pipeline.handoff import Handoff
from strata.pipeline.request import ImageEmbedding, Request, TokenEvent, pack_events, unpack_events
from strata.pipeline.sampling_params import SamplingParams
from strata.pipeline.sequence import Sequence
from strata.stages.factory import build_decode_service, build_prefill_service
from helpers import build, greedy

PROMPTS = ["Tell me about the tides and the moon. " * 6, "A short one.", "Why is the sea salty? " * 3]


@pytest.fixture(scope="module")
def services(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    config = EngineConfig(host_kv_blocks=512, host_kv_dir=str(tmp_path_factory.mktemp("host")))
    prefill, decode = build_prefill_service(llama_dir, config), build_decode_service(llama_dir, config)
    yield prefill, decode
    prefill.close()
    decode.close()


def _request(engine, rid: str, prompt: str, params: SamplingParams) -> Request:
    return engine.intake.make_request(rid, params, prompt=prompt)[0]


async def _complete(prefill, decode, request: Request) -> tuple[list[int], str, int]:
    handoff = Handoff.from_msgpack((await prefill.prefill(request)).to_msgpack())  # as it crosses replicas
    tokens, text = [handoff.first.token_id], handoff.first.text_delta
    if not handoff.first.finished:
        async for batch in decode.generate(handoff):
            batch = unpack_events(pack_events(batch))
            assert {e.request_id for e in batch} == {request.request_id}
            tokens += [e.token_id for e in batch]
            text += "".join(e.text_delta for e in batch)
    return tokens, text, handoff.num_cached_tokens


def test_concurrent_requests_through_two_services_match_the_in_process_engine(services, llama_dir: Path) -> None:
    prefill, decode = services
    engine = build(llama_dir)
    params = [greedy(12), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7), greedy(12, stop=["e"])]
    expected = engine.generate([{"prompt": p, "params": sp} for p, sp in zip(PROMPTS, params)])

    async def main():
        requests = [_request(engine, f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))]
        return await asyncio.gather(*(_complete(prefill, decode, r) for r in requests))

    before = asyncio.run(decode.stats())["handoff_tokens"]
    got = asyncio.run(main())
    after = asyncio.run(decode.stats())["handoff_tokens"]
    # Decode took every prompt's KV over (full blocks from the host tier, the partial tail shipped in
    # the hand-off) and recomputed nothing.
    prompt_tokens = sum(len(engine.intake.make_request("x", greedy(1), prompt=p)[0].prompt_token_ids) for p in PROMPTS)
    assert after["recomputed"] == before["recomputed"]
    assert after["adopted"] - before["adopted"] == prompt_tokens
    assert any(exp.finish_reason == "stop" for exp in expected)  # the stop-string case is covered
    for (tokens, text, _), exp in zip(got, expected):
        assert tokens == exp.output_token_ids  # seeded sampling continues from prefill's generator state
        assert text == exp.text  # streamed text, stop strings and EOS included, equals the engine's


def test_a_second_turn_hits_the_prefix_cache(services, llama_dir: Path) -> None:
    prefill, decode = services
    engine = build(llama_dir)
    asyncio.run(_complete(prefill, decode, _request(engine, "turn", PROMPTS[0], greedy(4))))
    _, _, cached = asyncio.run(_complete(prefill, decode, _request(engine, "turn-again", PROMPTS[0], greedy(4))))
    assert cached >= 48


def test_closing_a_stream_early_frees_the_decode_blocks(services, llama_dir: Path) -> None:
    prefill, decode = services
    engine = build(llama_dir)

    async def main() -> None:
        baseline = (await decode.stats())["kv"]["device"]["in_use"]
        handoff = await prefill.prefill(_request(engine, "gone", PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True, temperature=0)))
        stream = decode.generate(handoff)
        await stream.__anext__()
        assert (await decode.stats())["running"] == 1
        await stream.aclose()  # what a client disconnect does to the Ray streaming call
        for _ in range(100):
            stats = await decode.stats()
            if stats["running"] == 0 and stats["kv"]["device"]["in_use"] == baseline:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"blocks not released: {stats}")

    asyncio.run(main())


def test_the_handoff_round_trip_keeps_decoding_state() -> None:
    import numpy as np
    import torch

    embeds = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    seq = Sequence("w", [1, 4, 4, 9], SamplingParams(max_tokens=3, seed=5, stop=["x"]), 16,
                   [ImageEmbedding(1, embeds, b"h" * 16)])
    seq.token_ids.append(42)
    seq.text, seq.emitted_text_len = "ab", 1
    torch.rand(3, generator=seq.generator)  # advance the generator
    first = TokenEvent("w", 42, "ab", None, 0)
    back = Handoff.from_msgpack(Handoff.from_sequence(seq, first, b"kv").to_msgpack())
    assert back.first == first and back.kv_handle == b"kv"
    again = back.to_sequence(16)
    assert again.token_ids == seq.token_ids and again.num_prompt_tokens == 4 and again.output_token_ids == [42]
    assert again.params == seq.params and again.text == "ab" and again.emitted_text_len == 1
    assert np.array_equal(again.images[0].embeds, embeds) and again.image_spans == seq.image_spans
    assert torch.equal(torch.rand(4, generator=again.generator), torch.rand(4, generator=seq.generator))


def test_requests_and_events_round_trip_through_msgpack() -> None:
    import numpy as np

    req = Request("cmpl-1", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.5, stop=["\n"]),
                  [ImageEmbedding(0, np.ones((3, 4), np.float32), b"c" * 16)])
    back = Request.from_msgpack(req.to_msgpack())
    assert (back.request_id, back.prompt_token_ids, back.params) == (req.request_id, req.prompt_token_ids, req.params)
    assert np.array_equal(back.images[0].embeds, req.images[0].embeds)
    events = [TokenEvent("a", 5, "x"), TokenEvent("b", 6, "", "length", 32)]
    assert unpack_events(pack_events(events)) == events
    with pytest.raises(ValueError, match="expected a request message"):
        Request.from_msgpack(pack_events(events))


def test_separate_processes_need_a_shared_tier(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="host tier"):
        build_prefill_service(llama_dir, EngineConfig())


def test_a_block_missing_from_the_host_tier_is_recomputed_by_decode(services, llama_dir: Path) -> None:
    """A hand-off whose full block vanished from the shared tier is recomputed, never served wrong."""
    prefill, decode = services
    engine = build(llama_dir)
    prompt = "A story about a lighthouse, the sea and the keeper who never slept. " * 3
    expected = engine.generate([{"prompt": prompt, "params": greedy(8)}])[0].output_token_ids

    async def main() -> tuple[list[int], dict]:
        handoff = await prefill.prefill(_request(engine, "lost-block", prompt, greedy(8)))
        handle = KVHandle.from_bytes(handoff.kv_handle)
        tier = prefill.prefiller.kv.lower.top
        tier.remove(handle.block_hashes[1])  # gone from the host tier before decode adopts it
        before = (await decode.stats())["handoff_tokens"]
        tokens = [handoff.first.token_id]
        async for batch in decode.generate(handoff):
            tokens += [e.token_id for e in batch]
        after = (await decode.stats())["handoff_tokens"]
        return tokens, {k: after[k] - before[k] for k in after}

    tokens, delta = asyncio.run(main())
    assert tokens == expected
    assert delta["recomputed"] > 0 and delta["adopted"] == 0

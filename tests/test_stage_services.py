"""Prefill and decode as separate services (own models, own pools, KV through the host tier),
driven from asyncio the way the Ray deployments drive them — before any Ray is involved."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from helpers import build, greedy
from strata.kvstore import KVHandle
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.contract.handoff import Handoff
from strata.pipeline.contract.request import ImageEmbedding, Request, TokenEvent, pack_events, unpack_events
from strata.pipeline.contract.sampling_params import SamplingParams
from strata.pipeline.core.sequence import Sequence
from strata.stages.factory import build_decode_service, build_prefill_service

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
    handle = KVHandle(b"fp" * 8, 4, [], [3], "pool", tail_block=3)
    back = Handoff.from_msgpack(seq.to_handoff(first, handle).to_msgpack())
    assert back.first == first and back.kv_handle == handle
    again = Sequence.from_handoff(back, 16)
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


def test_the_arrival_time_travels_so_decode_keeps_the_request_deadline() -> None:
    """Prefill took 500 s of a 600 s deadline: decode's sequence is dated back to the request's arrival
    (it used to restart the clock when it took the hand-off over)."""
    import time

    arrived = time.time() - 500
    req = Request.from_msgpack(Request("r", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=arrived).to_msgpack())
    assert req.arrival_time == arrived
    seq = Sequence.from_request(req, 16)
    seq.token_ids.append(7)
    decode_side = Sequence.from_handoff(Handoff.from_msgpack(seq.to_handoff(TokenEvent("r", 7), None).to_msgpack()), 16)
    assert decode_side.arrival_time == arrived
    assert 499 < time.monotonic() - decode_side.arrival < 510


def test_an_old_message_version_is_refused_with_a_clear_error() -> None:
    """A replica of the previous release sends version 1 (no arrival time): refused by name, never
    half-read with a restarted deadline."""
    import msgpack

    from strata.pipeline.contract.wire import WireError

    old_request = msgpack.packb({"kind": "request", "v": 1, "id": "r", "prompt": [1, 2], "params": {}, "images": []})
    with pytest.raises(WireError, match=r"expected a request message version 2, got \('request', 1\)"):
        Request.from_msgpack(old_request)
    old_handoff = msgpack.packb({"kind": "handoff", "v": 1, "id": "r", "tokens": [1, 2]})
    with pytest.raises(WireError, match=r"expected a handoff message version 4, got \('handoff', 1\)"):
        Handoff.from_msgpack(old_handoff)
    state = Sequence("r", [1, 2], SamplingParams(), 16).to_handoff(TokenEvent("r", 2), None)
    v2 = msgpack.unpackb(state.to_msgpack())
    v2.update(v=2, kv_handle=b"a hand-packed handle")  # the previous release's hand-off: the handle as bytes
    with pytest.raises(WireError, match=r"expected a handoff message version 4, got \('handoff', 2\)"):
        Handoff.from_msgpack(msgpack.packb(v2))
    v3 = msgpack.unpackb(state.to_msgpack())
    v3.pop("linear_state", None)
    v3.update(v=3)  # the previous release's: no linear-attention state (a hybrid's decode would start from zeros)
    with pytest.raises(WireError, match=r"expected a handoff message version 4, got \('handoff', 3\)"):
        Handoff.from_msgpack(msgpack.packb(v3))
    newer = Request("r", [1], SamplingParams()).to_msgpack().replace(b"\xa1v\x02", b"\xa1v\x03")
    with pytest.raises(WireError, match=r"version 2, got \('request', 3\)"):
        Request.from_msgpack(newer)
    with pytest.raises(WireError, match="not a msgpack message"):
        Request.from_msgpack(b"\xc1garbage")


def test_every_field_of_the_sequence_state_reaches_decode() -> None:
    """The state is declared once (SequenceState); prefill's Sequence is copied into it by field name
    and decode's out of it. Give each field a value of its own on the prefill side, send the hand-off
    through the wire, and find each on the decode side: a field added to SequenceState is covered."""
    import time

    import numpy as np

    from strata.pipeline.contract.handoff import SequenceState

    seq = Sequence("req-7", [5, 6, 7, 8], SamplingParams(max_tokens=9, seed=11, stop=["z"]), 16,
                   [ImageEmbedding(1, np.full((2, 4), 0.5, np.float32), b"i" * 16)])
    seq.token_ids += [40, 41]
    seq.text, seq.emitted_text_len, seq.num_cached_tokens, seq.num_preemptions = "hey", 2, 16, 3
    seq.detokenizer.prefix_offset, seq.detokenizer.read_offset = 1, 2
    seq.arrived_at(time.time() - 30)
    sent = seq.state()
    got = Sequence.from_handoff(Handoff.from_msgpack(seq.to_handoff(TokenEvent("req-7", 41), None).to_msgpack()), 16)
    received = got.state()
    for name in SequenceState.__struct_fields__:
        a, b = getattr(sent, name), getattr(received, name)
        if name == "images":
            assert [(i.offset, i.content_hash) for i in a] == [(i.offset, i.content_hash) for i in b]
            assert all(np.array_equal(x.embeds, y.embeds) for x, y in zip(a, b))
        else:
            assert a == b, name


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
        handle = handoff.kv_handle
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

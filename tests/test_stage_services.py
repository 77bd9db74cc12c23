"""Prefill and decode as separate services (own models, own pools, KV through the host tier),
driven from asyncio the way the Ray deployments drive them — before any Ray is involved."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pipeline.config import EngineConfig
from pipeline.sampling_params import SamplingParams
from pipeline.sequence import Sequence
from pipeline.sequence_wire import sequence_from_wire, sequence_to_wire
from stages.factory import build_decode_service, build_prefill_service
from tests.helpers import build, greedy

PROMPTS = ["Tell me about the tides and the moon. " * 6, "A short one.", "Why is the sea salty? " * 3]


@pytest.fixture(scope="module")
def services(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    config = EngineConfig(host_kv_blocks=512, host_kv_dir=str(tmp_path_factory.mktemp("host")))
    prefill, decode = build_prefill_service(llama_dir, config), build_decode_service(llama_dir, config)
    yield prefill, decode
    prefill.close()
    decode.close()


def _wire(engine, rid: str, prompt: str, params: SamplingParams) -> dict:
    enc = engine.tokenizer.encode(engine.tokenizer.render_user_prompt(prompt), 0)
    return sequence_to_wire(Sequence(rid, enc.token_ids, params, 16))


async def _complete(prefill, decode, wire: dict) -> tuple[list[int], str, int]:
    first = await prefill.prefill(wire)
    tokens, text = [first["token_id"]], first["text_delta"]
    if not first["finished"]:
        async for batch in decode.generate(first["seq"], first["handle"]):
            tokens += [e["token_id"] for e in batch]
            text += "".join(e["text_delta"] for e in batch)
    return tokens, text, first["num_cached_tokens"]


def test_concurrent_requests_through_two_services_match_the_in_process_engine(services, llama_dir: Path) -> None:
    prefill, decode = services
    engine = build(llama_dir)
    params = [greedy(12), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7), greedy(12, stop=["e"])]
    expected = engine.generate([{"prompt": p, "params": sp} for p, sp in zip(PROMPTS, params)])

    async def main():
        wires = [_wire(engine, f"s{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params))]
        return await asyncio.gather(*(_complete(prefill, decode, w) for w in wires))

    got = asyncio.run(main())
    for (tokens, text, _), exp in zip(got, expected):
        assert tokens == exp.output_token_ids  # seeded sampling continues from prefill's generator state
        assert text == engine.tokenizer.decode(exp.output_token_ids) or exp.finish_reason == "stop"


def test_a_second_turn_hits_the_prefix_cache(services, llama_dir: Path) -> None:
    prefill, decode = services
    engine = build(llama_dir)
    wire = _wire(engine, "turn", PROMPTS[0], greedy(4))
    asyncio.run(_complete(prefill, decode, wire))
    wire["seq_id"] = "turn-again"
    _, _, cached = asyncio.run(_complete(prefill, decode, wire))
    assert cached >= 48


def test_closing_a_stream_early_frees_the_decode_blocks(services, llama_dir: Path) -> None:
    prefill, decode = services
    engine = build(llama_dir)

    async def main() -> None:
        baseline = (await decode.stats())["kv"]["device"]["in_use"]
        first = await prefill.prefill(_wire(engine, "gone", PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True, temperature=0)))
        stream = decode.generate(first["seq"], first["handle"])
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


def test_the_sequence_wire_round_trip_keeps_decoding_state(demo_images) -> None:
    import torch

    from pipeline.sequence import ImageEmbedding

    seq = Sequence("w", [1, 4, 4, 9], SamplingParams(max_tokens=3, seed=5, stop=["x"]), 16,
                   [ImageEmbedding(1, torch.randn(2, 8), b"h" * 16)])
    seq.token_ids.append(42)
    seq.text, seq.emitted_text_len = "ab", 1
    torch.rand(3, generator=seq.generator)  # advance the generator
    back = sequence_from_wire(sequence_to_wire(seq), 16)
    assert back.token_ids == seq.token_ids and back.num_prompt_tokens == 4 and back.output_token_ids == [42]
    assert back.params == seq.params and back.text == "ab" and back.emitted_text_len == 1
    assert torch.equal(back.images[0].embeds, seq.images[0].embeds) and back.image_spans == seq.image_spans
    assert torch.equal(torch.rand(4, generator=back.generator), torch.rand(4, generator=seq.generator))


def test_separate_processes_need_a_shared_tier(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="host tier"):
        build_prefill_service(llama_dir, EngineConfig())

"""Linear attention with its per-sequence state cache, Gated DeltaNet (Qwen3-Next) and KDA (Kimi-Linear): the
engine through chunks, batches, preemption, spills, prefix hits (snapshots in the tiers too), failing rows,
hand-offs and refusals. The kernels and the pool's slots are in test_delta_rule.py, tensor parallelism in
test_linear_attention_tp.py. Greedy tokens against transformers'
generate, `strata ops` and `strata align` for the families are in test_text_models.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import (assert_preemption_recomputes_the_same, build, greedy, spilling_engine, tokens_through_handoff,
                     transformers_greedy)
from strata.kvstore.hashing import hash_chain
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.parallel.shard_plan import ShardingError

PROMPTS = ["What is the capital of France? The quick brown fox jumps over the lazy dog.",
           "Tell me about the tides and the moon. " * 4, "A short one."]


@pytest.fixture(scope="module")
def qwen3_next(text_models) -> Path:
    return text_models["qwen3_next"]


@pytest.fixture(scope="module", params=["qwen3_next", "kimi_linear"])
def hybrid(request, text_models) -> Path:
    """Each hybrid in turn: Gated DeltaNet beside gated GQA (Qwen3-Next), KDA beside MLA (Kimi-Linear)."""
    return text_models[request.param]


@pytest.mark.parametrize("chunk", [5, 16])
def test_prefill_chunks_cut_through_the_recurrence(chunk: int, hybrid: Path) -> None:
    """Chunks of 5 and 16 tokens (inside and across the delta rule's blocks), three sequences mixing prefill
    and decode in one step: every answer is transformers', and every state slot is back after."""
    engine = build(hybrid, prefill_chunk_tokens=chunk, max_num_batched_tokens=24, max_num_seqs=4)
    outs = engine.generate([{"prompt": p, "params": greedy(12, ignore_eos=True)} for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs):
        assert out.output_token_ids == transformers_greedy(hybrid, prompt, 12), prompt
    assert engine.kv.states.pool.stats()["in_use"] == 0
    engine.kv.states.check_invariants()


def test_preempted_sequences_restart_their_state(hybrid: Path) -> None:
    assert_preemption_recomputes_the_same(hybrid, PROMPTS)


def test_spilled_attention_blocks_and_the_state_together(hybrid: Path, tmp_path: Path) -> None:
    """A prompt longer than the device pool: the full-attention layer's older blocks stream from the host
    tier while the linear layers' state stays on the device; the answer is the engine's without tiers."""
    prompt = " ".join(["the harbour light"] * 60)
    want = build(hybrid).generate([{"prompt": prompt, "params": greedy(12, ignore_eos=True)}])[0]
    engine = spilling_engine(hybrid, tmp_path / "host")
    out = engine.generate([{"prompt": prompt, "params": greedy(12, ignore_eos=True)}])[0]
    assert out.output_token_ids == want.output_token_ids and engine.kv.spills.peak > 4


def test_a_prefix_hit_restores_the_state_with_the_blocks(hybrid: Path) -> None:
    """The prompt's state at its last block boundary is published when its prefill ends, and the whole
    sequence's when it finishes: the same prompt again, and a next turn that extends prompt and answer,
    adopt blocks and state up to those boundaries and answer as a fresh engine does."""
    engine, fresh = build(hybrid), build(hybrid)
    params = greedy(8, ignore_eos=True)
    first = engine.generate([{"prompt": PROMPTS[1], "params": params}])[0]
    again = engine.generate([{"prompt": PROMPTS[1], "params": params}])[0]
    assert again.output_token_ids == first.output_token_ids
    assert again.num_cached_tokens == (first.num_prompt_tokens - 1) // 16 * 16 > 0
    ids = list(engine.intake.make_request("t", params, prompt=PROMPTS[1])[0].prompt_token_ids) + first.output_token_ids
    turn = {"prompt_token_ids": ids + ids[:20], "params": params}  # the first sequence, then more
    second = engine.generate([turn])[0]
    assert second.output_token_ids == fresh.generate([turn])[0].output_token_ids
    assert second.num_cached_tokens == len(ids) // 16 * 16 > again.num_cached_tokens
    engine.kv.states.check_invariants()
    assert engine.kv.states.stats()["hits"] == 2


def test_blocks_whose_state_snapshot_was_evicted_are_computed_again(qwen3_next: Path) -> None:
    """Two snapshot slots, three prompts: the first prompt's snapshot is evicted while its blocks stay
    cached, so a repeat adopts nothing (never blocks without their state) and still answers alike."""
    engine = build(qwen3_next, max_num_seqs=2, max_num_batched_tokens=256)
    params = greedy(6, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[0] * 2, PROMPTS[1][::-1]]
    outs = [engine.generate([{"prompt": p, "params": params}])[0] for p in prompts]
    ids = engine.intake.make_request("r", params, prompt=prompts[0])[0].prompt_token_ids
    hashes = hash_chain(engine.kv.fingerprint, ids[: len(ids) // 16 * 16], 16)
    assert len(engine.kv.matcher.locate(hashes)) == len(hashes)  # its blocks are all still cached
    repeat = engine.generate([{"prompt": prompts[0], "params": params}])[0]
    assert repeat.output_token_ids == outs[0].output_token_ids and repeat.num_cached_tokens == 0
    engine.kv.states.check_invariants()


def test_a_snapshot_the_device_evicted_comes_back_from_the_host_tier(qwen3_next: Path, tmp_path: Path) -> None:
    """Two snapshot slots, three prompts, a host tier: the first prompt's evicted snapshot is kept there in
    block-sized pieces, so a repeat adopts its blocks and its state and answers as a fresh engine does; so does
    another engine over the same tier, which finds the pieces in its files. With a piece deleted, the next
    repeat computes everything again (never blocks without their state)."""
    from strata.kvstore.hashing import state_piece_hash

    params = greedy(6, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[0] * 2, PROMPTS[1][::-1]]
    engine = build(qwen3_next, max_num_seqs=2, max_num_batched_tokens=256, host_kv_blocks=256,
                   host_kv_dir=str(tmp_path / "host"))
    want = build(qwen3_next).generate([{"prompt": prompts[0], "params": params}])[0].output_token_ids
    for prompt in prompts:
        engine.generate([{"prompt": prompt, "params": params}])
    assert engine.kv.states.stats()["stored_below"] >= 1
    repeat = engine.generate([{"prompt": prompts[0], "params": params}])[0]
    assert repeat.output_token_ids == want and repeat.num_cached_tokens > 0
    assert engine.kv.states.stats()["loaded_from_below"] == 1
    for prompt in prompts[1:]:  # the first prompt's snapshot is evicted, and kept below, again
        engine.generate([{"prompt": prompt, "params": params}])
    engine.kv.lower.flush()
    other = build(qwen3_next, max_num_seqs=2, max_num_batched_tokens=256, host_kv_blocks=256,
                  host_kv_dir=str(tmp_path / "host"))
    there = other.generate([{"prompt": prompts[0], "params": params}])[0]
    assert there.output_token_ids == want and there.num_cached_tokens == repeat.num_cached_tokens
    assert other.kv.states.stats()["loaded_from_below"] == 1
    ids = engine.intake.make_request("r", params, prompt=prompts[0])[0].prompt_token_ids
    key = hash_chain(engine.kv.fingerprint, ids[: repeat.num_cached_tokens], 16)[-1]
    Path(engine.kv.lower.top.files.path(state_piece_hash(key, 0))).unlink()
    again = engine.generate([{"prompt": prompts[0], "params": params}])[0]
    assert again.output_token_ids == want and again.num_cached_tokens == 0
    assert engine.kv.states.stats()["missed_below"] == 1
    engine.kv.states.check_invariants()


def _culprit_fails_alone(engine, requests: list[dict], want: list[list[int]]) -> None:
    """Run ``requests`` at once, the first as "bad": it ends in an error, the others answer ``want``, and no
    state slot or block is left held."""
    ids = [engine.add_request(**r) for r in requests[1:]]
    engine.add_request(**requests[0], request_id="bad")
    events = list(engine.run())
    assert [e for e in events if e.request_id == "bad"][-1].finish_reason == "error"
    assert [[e.token_id for e in events if e.request_id == i] for i in ids] == want
    assert engine.kv.states.pool.stats()["in_use"] == 0 and engine.kv.pool.stats()["in_use"] == 0
    engine.kv.states.check_invariants()


def test_a_failing_row_gives_its_state_slot_back(qwen3_next: Path, monkeypatch) -> None:
    """NaN logits fail one request; the others answer as alone and no state slot or block leaks."""
    from strata.pipeline.core.model_runner import ModelRunner

    requests = [{"prompt": p, "params": greedy(8, ignore_eos=True)} for p in PROMPTS]
    want = [o.output_token_ids for o in build(qwen3_next).generate(requests[1:])]
    engine = build(qwen3_next)
    original = ModelRunner.execute

    def poisoned(self, chunks):
        logits, row = original(self, chunks).clone(), 0
        for chunk in (c for c in chunks if c.samples):
            if chunk.seq.request_id == "bad":
                logits[row] = float("nan")
            row += 1
        return logits

    monkeypatch.setattr(ModelRunner, "execute", poisoned)
    _culprit_fails_alone(engine, requests, want)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_step_that_raises_after_the_linear_layers_ran_leaves_every_state_as_it_was(qwen3_next: Path, tp: int,
                                                                                   monkeypatch) -> None:
    """The full-attention layer (after three linear ones) raises whenever one request is in the step: the
    batch is rerun chunk by chunk from the states the failed step read (it wrote only the spare slots), so
    the others answer exactly as alone, and the culprit fails alone. At tp=2 the driver's layer raises after
    the worker ran its linear layers: the group abandons the step, and the worker's slots are as good as the
    driver's."""
    from strata.pipeline.core.model_runner import ModelRunner
    from strata.pipeline.models.decoder import Attention

    requests = [{"prompt": p, "params": greedy(8, ignore_eos=True)} for p in PROMPTS]
    want = [o.output_token_ids for o in build(qwen3_next).generate(requests[1:])]
    prepare, attend, step = ModelRunner.prepare, Attention.attend, {"bad": False}

    def noting(self, chunks):
        step["bad"] = any(c.seq.request_id == "bad" and c.seq.output_token_ids for c in chunks)
        return prepare(self, chunks)

    def raising(self, *args, **kwargs):
        if step["bad"]:
            raise RuntimeError("poisoned row")
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "prepare", noting)
    monkeypatch.setattr(Attention, "attend", raising)
    engine = build(qwen3_next, tp=tp)
    try:
        _culprit_fails_alone(engine, requests, want)
        if tp > 1:  # each failed step was given up by the whole group, which stayed in step
            group = engine.core.runner.group
            assert group.abandoned_steps > 0 and not group.broken
    finally:
        engine.close()


def test_what_linear_attention_cannot_run_with_is_refused_in_one_line(qwen3_next: Path) -> None:
    with pytest.raises(ShardingError, match="tp=4 does not divide the model's 2 linear-attention key heads"):
        build(qwen3_next, tp=4)
    with pytest.raises(ModelConfigError, match="compile: false"):
        build(qwen3_next, compile=True)
    with pytest.raises(ModelConfigError, match="without speculation"):
        build(qwen3_next, speculative={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("prompt", [PROMPTS[1], PROMPTS[2]], ids=["blocks-and-tail", "tail-only"])
def test_the_state_crosses_the_hand_off(prompt: str, hybrid: Path, tmp_path: Path) -> None:
    """Prefilled by one service, decoded by another over the host tier: the state after the prompt crosses
    in the hand-off message beside the tail block (and the full blocks by hash), and the answer is the
    in-process engine's."""
    engine = build(hybrid)
    want = engine.generate([{"prompt": prompt, "params": greedy(10, ignore_eos=True)}])[0].output_token_ids
    config = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "host"))
    shipped: list[int] = []
    got = tokens_through_handoff(hybrid, config, engine, [], prompt, greedy(10, ignore_eos=True),
                                 check=lambda request, handoff: shipped.append(len(handoff.linear_state)))
    assert got == want and shipped == [engine.kv.states.pool.bytes_per_sequence()]


def test_a_hand_off_without_its_state_or_with_a_cut_one_is_refused(qwen3_next: Path, tmp_path: Path) -> None:
    import asyncio

    import msgspec

    from strata.kvstore import HandleError
    from strata.stages.factory import build_decode_service, build_prefill_service

    engine = build(qwen3_next)
    config = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "host"))
    prefill, decode = build_prefill_service(qwen3_next, config), build_decode_service(qwen3_next, config)

    async def run() -> None:
        handoff = await prefill.prefill(engine.prepare("h", greedy(4, ignore_eos=True), [], prompt=PROMPTS[1]))
        async for _ in decode.generate(msgspec.structs.replace(handoff, linear_state=b"")):
            pass

    async def truncated() -> None:
        handoff = await prefill.prefill(engine.prepare("t", greedy(4, ignore_eos=True), [], prompt=PROMPTS[1]))
        async for _ in decode.generate(msgspec.structs.replace(handoff, linear_state=handoff.linear_state[:-4])):
            pass

    try:
        with pytest.raises(HandleError, match="carries no state"):
            asyncio.run(run())
        with pytest.raises(HandleError, match="linear-attention state has"):
            asyncio.run(truncated())
        assert decode.decoder.kv.states.pool.stats()["in_use"] == 0 and decode.decoder.kv.pool.stats()["in_use"] == 0
    finally:
        prefill.close()
        decode.close()


def test_a_kv_memory_budget_pays_for_the_state_slots_first(qwen3_next: Path) -> None:
    """``kv_cache_memory`` buys blocks after the fixed state slots: the pool built holds what the budget
    left, and the state pool's bytes are what the budget set aside for it."""
    from strata.stages.kv_budget import state_pool_bytes

    engine = build(qwen3_next, kv_cache_memory="4MiB")
    pool = engine.kv.states.pool
    held = sum(t.numel() * t.element_size() for t in pool.tensors.values())
    assert held == state_pool_bytes(engine.model_config.text, engine.config)
    # a rank of two holds half of every state (its heads'), and its budget sets aside that much
    assert 2 * state_pool_bytes(engine.model_config.text, engine.config.model_copy(update={"tp": 2})) == held
    assert engine.kv.pool.kv.nbytes() <= 4 * 2**20 - held < engine.kv.pool.kv.nbytes() + engine.kv.pool.kv.block_nbytes()

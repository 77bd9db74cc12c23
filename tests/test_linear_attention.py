"""Linear attention with its per-sequence state cache, Gated DeltaNet (Qwen3-Next) and KDA (Kimi-Linear): the
torch kernels against transformers' reference functions, the state pool's slots, and the engine through
chunks, batches, preemption, spills, prefix hits, hand-offs and refusals. Greedy tokens against transformers'
generate, `strata ops` and `strata align` for the families are in test_text_models.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import (assert_preemption_recomputes_the_same, build, greedy, spilling_engine, tokens_through_handoff,
                     transformers_greedy)
from strata.kernels.delta_rule import (causal_conv, causal_conv_step, delta_rule_chunked, delta_rule_step,
                                       l2_normalize, l2_normalize_div)
from strata.kvstore.hashing import hash_chain
from strata.kvstore.state_pool import StateKind, StatePool
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.core.tp_states import ShardedStatePool
from strata.pipeline.models.config_errors import ModelConfigError
from strata.pipeline.models.model_config import load_model_config
from strata.pipeline.parallel.shard_plan import ShardingError, ShardPlan

PROMPTS = ["What is the capital of France? The quick brown fox jumps over the lazy dog.",
           "Tell me about the tides and the moon. " * 4, "A short one."]


def _inputs(t: int, h: int = 4, k: int = 16, v: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, key = torch.randn(t, h, k, generator=gen), torch.randn(t, h, k, generator=gen)
    val = torch.randn(t, h, v, generator=gen)
    g, beta = -torch.rand(t, h, generator=gen), torch.rand(t, h, generator=gen)
    state = torch.randn(h, k, v, generator=gen) * 0.1
    return q, key, val, g, beta, state


def test_the_chunked_delta_rule_is_transformers_and_continues_across_any_cut() -> None:
    """One pass equals transformers' chunked reference to the bit; the same rows cut at 23 (mid-block)
    continue the state, and decode steps one row at a time agree, to fp32 rounding."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta, state = _inputs(70)
    want, want_state = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                    initial_state=state[None], output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    qn, kn = l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)
    out, final = delta_rule_chunked(qn, kn, v, g, beta, state)
    assert torch.equal(out, want[0]) and torch.equal(final, want_state[0])
    _cut_and_stepped_agree((qn, kn, v, g, beta), state, want[0], want_state[0], want[0])


def _cut_and_stepped_agree(rows: tuple[torch.Tensor, ...], state: torch.Tensor, want: torch.Tensor,
                           want_state: torch.Tensor, stepped: torch.Tensor) -> None:
    """The rows cut at 23 (mid-block) continue the state to ``want`` / ``want_state``, and decode steps one
    row at a time give ``stepped``, each to fp32 rounding."""
    first, mid = delta_rule_chunked(*(x[:23] for x in rows), state)
    rest, end = delta_rule_chunked(*(x[23:] for x in rows), mid)
    torch.testing.assert_close(torch.cat([first, rest]), want, rtol=0, atol=2e-6)
    torch.testing.assert_close(end, want_state, rtol=0, atol=2e-6)
    s, steps = state[None], []
    for i in range(rows[0].shape[0]):
        o, s = delta_rule_step(*(x[i : i + 1] for x in rows), s)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps), stepped, rtol=0, atol=2e-6)


def test_the_per_channel_delta_rule_is_kimi_linears_and_continues_across_any_cut() -> None:
    """KDA's decay per key channel: one pass equals transformers' chunked reference and the decode steps its
    recurrent one, to fp32 rounding (its reference solves the block by forward substitution, ours by a
    triangular solve); cut at 23, the state continues; a steep decay stays finite. A decay averaged over the
    channels is far off."""
    from transformers.models.kimi_linear.modeling_kimi_linear import (chunk_kimi_delta_attention,
                                                                      recurrent_kimi_delta_attention)

    q, k, v, _, beta, state = _inputs(70, v=16)
    g = -torch.rand(70, 4, 16, generator=torch.Generator().manual_seed(5))
    args = (q[None], k[None], v[None], g[None], beta[None])
    want, want_state = chunk_kimi_delta_attention(*args, initial_state=state[None], output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    stepped, _ = recurrent_kimi_delta_attention(*args, initial_state=state[None], output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    qn, kn = l2_normalize_div(q) * q.shape[-1] ** -0.5, l2_normalize_div(k)
    out, final = delta_rule_chunked(qn, kn, v, g, beta, state)
    torch.testing.assert_close(out, want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(final, want_state[0], rtol=0, atol=1e-6)
    _cut_and_stepped_agree((qn, kn, v, g, beta), state, want[0], want_state[0], stepped[0])
    averaged, _ = delta_rule_chunked(qn, kn, v, g.mean(-1), beta, state)
    assert (averaged - want[0]).abs().max() > 1e-2
    steep = g * 40  # a block's decay falls to e^-1280 per channel: e^(-d) alone would overflow fp32
    want, _ = chunk_kimi_delta_attention(q[None], k[None], v[None], steep[None], beta[None], initial_state=state[None],
                                         use_qk_l2norm_in_kernel=True)
    out, _ = delta_rule_chunked(qn, kn, v, steep, beta, state)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_the_cpu_decode_step_kernel_equals_the_torch_step_over_pool_slots(per_channel: bool) -> None:
    """The C++ step reads each sequence's state from one slot of a layer's (strided) pool view and writes the
    new one to another, as the torch step does through a gather and a scatter; the slots it read are left
    as they were. Gated DeltaNet's decay per head and KDA's per key channel alike."""
    from strata.kernels.cpu_kernels import cpu_kernels
    from strata.kernels.delta_rule import delta_rule_step_slots

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ toolchain here")
    gen = torch.Generator().manual_seed(4)
    tensors = torch.randn(6, 3, 4, 16, 12, generator=gen)  # [slots, layers, heads, K, V]: layer 1's view strides
    pool = tensors[:, 1]
    b = 3
    q, k = l2_normalize(torch.randn(b, 4, 16, generator=gen)), l2_normalize(torch.randn(b, 4, 16, generator=gen))
    v, beta = torch.randn(b, 4, 12, generator=gen), torch.rand(b, 4, generator=gen)
    g = -torch.rand(*((b, 4, 16) if per_channel else (b, 4)), generator=gen)  # KDA: a decay per key channel
    read, write = torch.tensor([0, 2, 4]), torch.tensor([1, 3, 5])
    before, other_layers = pool.clone(), tensors[:, [0, 2]].clone()
    want, want_state = delta_rule_step(q, k, v, g, beta, before[read])
    out = kernels.delta_rule_step(q, k, v, g, beta, pool, read, write)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[write], want_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[read], before[read]) and torch.equal(tensors[:, [0, 2]], other_layers)
    torch.testing.assert_close(delta_rule_step_slots(q, k, v, g, beta, pool, read, write), want, rtol=1e-5, atol=1e-5)


def test_the_causal_convolution_continues_from_its_state() -> None:
    """Rows through the convolution in two calls, or one at a time, equal one call over all of them
    (transformers' causal_conv1d_fn, zero-padded as a new sequence starts)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(20, 8, generator=gen), torch.randn(8, 4, generator=gen)
    want = causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t()
    zero = torch.zeros(8, 3)
    a, state = causal_conv(x[:7], zero, weight)
    b, _ = causal_conv(x[7:], state, weight)
    torch.testing.assert_close(torch.cat([a, b]), want)
    state, rows = zero[None], []
    for i in range(20):
        out, state = causal_conv_step(x[i : i + 1], state, weight)
        rows.append(out)
    torch.testing.assert_close(torch.cat(rows), want)


def test_state_slots_are_claimed_zeroed_and_released_once() -> None:
    pool = StatePool((StateKind("conv", (4, 3), torch.float32), StateKind("recurrent", (2, 4, 4), torch.float32)),
                     num_layers=3, num_slots=2)
    a = pool.claim()
    pool.layer("recurrent", 1)[a].fill_(7.0)
    b = pool.claim()
    assert pool.claim() is None and pool.num_free == 0  # every slot held: the KV cache's reserve then fails
    pool.release(a)
    again = pool.claim()
    assert again == a and not pool.tensors["recurrent"][again].any()  # a new sequence starts from zeros
    pool.release(b)
    with pytest.raises(ValueError, match="not claimed"):
        pool.release(b)
    pool.check_invariants()
    assert pool.bytes_per_sequence() == 3 * (4 * 3 + 2 * 4 * 4) * 4


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


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_text", "kimi_linear"])
def any_hybrid(request, text_models) -> Path:
    """Every hybrid's linear layer: Qwen3-Next's fused per-key-head projections, Qwen3.5's projections apart
    (q|k|v cut in three ranges), Kimi-Linear's KDA."""
    return text_models[request.param]


def test_tp2_equals_tp1(any_hybrid: Path, tmp_path: Path, monkeypatch) -> None:
    """Two ranks, each with half the key and value heads and their half of every state: through 5-token
    chunks mixing prefill and decode, a prefix hit (a snapshot copied on every rank), preemption (slots
    zeroed again), and hand-offs both ways (the state gathered from both ranks into tp=1's bytes, and
    scattered from them), every answer is tp=1's and every slot is back."""
    reqs = [{"prompt": p, "params": greedy(10, ignore_eos=True)} for p in PROMPTS]
    one = build(any_hybrid)
    want = [o.output_token_ids for o in one.generate(reqs)]
    two = build(any_hybrid, tp=2, prefill_chunk_tokens=5, max_num_batched_tokens=24, max_num_seqs=4)
    try:
        assert [o.output_token_ids for o in two.generate(reqs)] == want
        again = two.generate(reqs[1:2])[0]
        assert again.output_token_ids == want[1] and again.num_cached_tokens > 0
        assert two.kv.states.pool.stats()["in_use"] == 0
        two.kv.states.check_invariants()
    finally:
        two.close()
    grown = [{"prompt": p, "params": greedy(24, ignore_eos=True)} for p in [*PROMPTS, PROMPTS[1] + " Again."]]
    alone = [o.output_token_ids for o in one.generate(grown)]
    preempting = build(any_hybrid, tp=2, num_kv_blocks=14, max_num_batched_tokens=64, prefill_chunk_tokens=32,
                       enable_prefix_caching=False)
    try:
        assert [o.output_token_ids for o in preempting.generate(grown)] == alone
        assert preempting.scheduler.num_preemptions > 0
    finally:
        preempting.close()
    tp1 = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "host"))
    tp2 = tp1.model_copy(update={"tp": 2})
    installed, install = [], ShardedStatePool.write

    def counted(pool: ShardedStatePool, slot: int, data: bytes) -> None:
        installed.append(slot)
        install(pool, slot, data)

    monkeypatch.setattr(ShardedStatePool, "write", counted)
    for prefill, decode in ((tp2, tp1), (tp1, tp2)):
        assert tokens_through_handoff(any_hybrid, prefill, one, [], PROMPTS[1], greedy(10, ignore_eos=True),
                                      decode_config=decode) == want[1]
    assert len(installed) == 1  # the tp=2 decode took tp=1's state: its blocks adopted, not computed again


def test_a_rank_reads_its_key_heads_and_the_value_heads_they_serve(text_models) -> None:
    """Rank 1 of 2 on Qwen3.5 (2 key heads, 4 value heads, 16 wide): its q, k and v of the fused projection
    and of the convolution are three ranges, read and joined; ``out_proj`` its value heads' input columns."""
    plan = ShardPlan(load_model_config(text_models["qwen3_5_text"]).text, 1, 2)
    three = (0, ((16, 32), (48, 64), (96, 128)))
    assert plan.cut_for("layers.0.linear_attn.in_proj_qkv.weight") == three
    assert plan.cut_for("layers.0.linear_attn.conv1d.weight") == three
    assert plan.cut_for("layers.0.linear_attn.in_proj_z.weight") == (0, ((32, 64),))
    assert plan.cut_for("layers.0.linear_attn.A_log") == (0, ((2, 4),))
    assert plan.cut_for("layers.0.linear_attn.out_proj.weight") == (1, ((32, 64),))
    assert plan.cut_for("layers.0.linear_attn.norm.weight") is None
    assert plan.linear_shards.state_cuts() == {"conv": three, "recurrent": (0, ((2, 4),))}
    with pytest.raises(ShardingError, match="3 ranges"):
        plan.slice_for("layers.0.linear_attn.conv1d.weight")


def test_what_linear_attention_cannot_run_with_is_refused_in_one_line(qwen3_next: Path) -> None:
    with pytest.raises(ShardingError, match="tp=4 does not divide the model's 2 linear-attention key heads"):
        build(qwen3_next, tp=4)
    with pytest.raises(ModelConfigError, match="kv_cache_dtype auto"):
        build(qwen3_next, kv_cache_dtype="fp8")
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

"""DeepSeek Sparse Attention (DeepSeek-V3.2, and GLM-5 with its interleaved indexer RoPE and a layer that
reuses the previous indexer's choice) on tiny checkpoints built by transformers' own classes, whose indexer
keeps 8 tokens of prompts four to ten times longer: the selection rule against transformers' at ties,
the indexer keys as a cache group of their own, and the engine through chunks, preemption, spills (reading
only the chosen latents' blocks), prefix hits, hand-offs and refusals. Greedy tokens against transformers'
generate on both backends, `strata ops` and `strata align` are in test_text_models.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import (assert_preemption_recomputes_the_same, build, greedy, spilling_engine, tokens_through_handoff,
                     transformers_greedy)
from strata.kernels.sparse_index import select_topk
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.models.config_errors import ModelConfigError

PROMPTS = ["What is the capital of France? The quick brown fox jumps over the lazy dog.",
           "Tell me about the tides and the moon. " * 4, "A short one."]


@pytest.fixture(scope="module")
def v32(text_models) -> Path:
    return text_models["deepseek_v32"]


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def dsa(request, text_models) -> Path:
    """Each DSA model in turn: DeepSeek-V3.2, GLM-5."""
    return text_models[request.param]


def test_the_top_k_rule_is_transformers_at_ties_and_at_every_chunk_cut() -> None:
    """Rows of a 40-token prompt whose scores are mostly exact zeros (every ReLU'd head closed): each row's
    top-8, however many of its keys a prefill chunk has seen so far, is the set transformers' forward picks
    over the whole prompt with torch.topk; a generated row's is picked over its context. Breaking ties by
    position instead, as a stable sort would, picks other tokens."""
    gen = torch.Generator().manual_seed(3)
    prompt, k = 40, 8
    scores = torch.where(torch.rand(prompt, prompt, generator=gen) < 0.8, 0.0, torch.rand(prompt, prompt, generator=gen))
    causal = torch.ones(prompt, prompt, dtype=torch.bool).tril()
    picked = scores.masked_fill(~causal, float("-inf")).topk(k, dim=-1).indices  # transformers' lines
    want = torch.zeros(prompt, prompt, dtype=torch.bool).scatter(1, picked, True) & causal
    for start, end in ((0, 40), (0, 5), (5, 21), (21, 40)):  # one pass, and chunks that cut it
        got = _as_mask(select_topk(scores[start:end, :end], list(range(start, end)), prompt, k), end)
        assert torch.equal(got, want[start:end, :end]), (start, end)
    positive = (scores > 0).tril().sum(-1)
    tied_rows = [r for r in range(k, prompt) if positive[r] < k < r + 1]  # the top-8 ends among the zeros
    assert len(tied_rows) > 10  # the boundary falls inside a tie of zeros on these rows
    stable = torch.zeros_like(want)
    for r in range(prompt):
        stable[r, torch.sort(scores[r, : r + 1], descending=True, stable=True).indices[:k]] = True
    assert not torch.equal(stable, want)
    generated = torch.rand(1, 50, generator=gen).masked_fill(torch.rand(1, 50, generator=gen) < 0.6, 0.0)
    row = select_topk(generated, [49], prompt, k)[0]
    assert torch.equal(row.sort().values, generated[0].topk(k).indices.sort().values)


def _as_mask(chosen: torch.Tensor, tokens: int) -> torch.Tensor:
    """select_topk's positions (-1: none) as a [rows, tokens] mask."""
    mask = torch.zeros(chosen.shape[0], tokens + 1, dtype=torch.bool)
    return mask.scatter_(1, chosen.clamp(min=-1) % (tokens + 1), True)[:, :tokens]


def test_the_cpu_index_scores_kernel_equals_the_torch_reference() -> None:
    """The fused C++ scores against transformers' matmul, ReLU and weighting: the exact zeros (every head's ReLU
    closed: the ties the top-k rule decides) stay exact zeros; token counts end mid-tile."""
    from strata.kernels.cpu_kernels import cpu_kernels
    from strata.kernels.sparse_index import index_scores_reference

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ toolchain here")
    gen = torch.Generator().manual_seed(2)
    for rows, heads, dim, tokens in ((1, 2, 16, 100), (7, 64, 128, 300), (512, 2, 16, 1000)):
        q, keys = torch.randn(rows, heads, dim, generator=gen), torch.randn(tokens, dim, generator=gen)
        weights = torch.randn(rows, heads, generator=gen)
        want = index_scores_reference(q, keys, weights, dim**-0.5)
        got = kernels.index_scores(q, keys, weights, dim**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got == 0, want == 0)
    assert (want == 0).sum() > 100


def test_the_indexer_keys_are_a_cache_group_of_their_own(v32: Path) -> None:
    """Group 0 holds the 3 layers' latents (32 + 8 values), group 1 their indexer keys (16 values): blocks,
    tiers, hashes and hand-offs carry both."""
    layout = build(v32).kv.layout
    latents, keys = layout.groups
    assert (latents.layers, latents.head_dim, keys.layers, keys.head_dim) == ((0, 1, 2), 40, (3, 4, 5), 16)
    assert layout.bytes_per_token() == 3 * (40 + 16) * 4


def test_a_layer_that_reuses_anothers_choice_caches_no_indexer_key(text_models) -> None:
    """GLM-5's third layer attends over the second's top-k: 4 latent layers, 3 of indexer keys."""
    latents, keys = build(text_models["glm_moe_dsa"]).kv.layout.groups
    assert (latents.layers, keys.layers) == ((0, 1, 2, 3), (4, 5, 6))


@pytest.mark.parametrize("chunk", [5, 16])
def test_prefill_chunks_cut_through_the_selection(chunk: int, dsa: Path) -> None:
    engine = build(dsa, prefill_chunk_tokens=chunk, max_num_batched_tokens=24, max_num_seqs=4)
    outs = engine.generate([{"prompt": p, "params": greedy(12, ignore_eos=True)} for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs):
        assert out.output_token_ids == transformers_greedy(dsa, prompt, 12), prompt


def test_preempted_sequences_select_the_same(dsa: Path) -> None:
    assert_preemption_recomputes_the_same(dsa, PROMPTS)


@pytest.mark.parametrize("mirror", [True, False], ids=["keys-kept-on-device", "keys-streamed"])
def test_spilled_latents_are_read_only_where_a_token_was_chosen(mirror: bool, v32: Path, tmp_path: Path,
                                                                 monkeypatch) -> None:
    """A prompt longer than the device pool: its older blocks live in the host tier. Of the latents only the
    blocks holding a chosen token are read back, fewer than the spilled blocks the steps could have read. The
    indexer keys (what chooses) are read back once per block and kept on the device; with no room kept for
    them, every step streams them all back. The answer is the engine's without tiers either way."""
    from strata.kvstore.spilled_reads import SpilledBlocks

    prompt = " ".join(["the harbour light"] * 60)
    want = build(v32).generate([{"prompt": prompt, "params": greedy(12, ignore_eos=True)}])[0]
    loads: list[tuple[int, int]] = []
    original = SpilledBlocks.load

    def counted(self, layer: int, first_block: int, num_blocks: int):
        loads.extend((layer, first_block + i) for i in range(num_blocks))
        return original(self, layer, first_block, num_blocks)

    monkeypatch.setattr(SpilledBlocks, "load", counted)
    engine = spilling_engine(v32, tmp_path / "host")
    if not mirror:
        engine.kv.layer_mirror.capacity_bytes = 0
    out = engine.generate([{"prompt": prompt, "params": greedy(12, ignore_eos=True)}])[0]
    assert out.output_token_ids == want.output_token_ids and engine.kv.spills.peak > 4
    latent_loads = [load for load in loads if load[0] < 3]
    key_loads = [load for load in loads if load[0] >= 3]
    reads = engine.kv.stats()["sparse_reads"]  # what /strata/stats reports
    assert 0 < reads["spilled_blocks_read"] == len(latent_loads) < reads["spilled_blocks_seen"] / 2
    assert reads["latent_bytes_spilled"] == len(latent_loads) * 16 * 40 * 4
    assert reads["index_key_bytes_spilled"] == len(key_loads) * 16 * 16 * 4
    if mirror:  # each spilled block's keys crossed once per layer
        assert len(key_loads) == len(set(key_loads)) == 3 * engine.kv.spills.peak
    else:
        assert len(key_loads) > 3 * len(set(key_loads))


def test_a_prefix_hit_selects_as_a_fresh_run(v32: Path) -> None:
    """The same prompt again adopts its blocks. A longer prompt with the same beginning adopts none: under the
    top-k rule a prefix's KV depends on the prompt's length (ties break over the whole prompt), so blocks are
    named by it too (``hashing.prompt_seed``), and that prompt answers as transformers does, not as the cached
    shorter prompt's KV would make it."""
    engine, fresh = build(v32), build(v32)
    params = greedy(8, ignore_eos=True)
    first = engine.generate([{"prompt": PROMPTS[1], "params": params}])[0]
    again = engine.generate([{"prompt": PROMPTS[1], "params": params}])[0]
    assert again.output_token_ids == first.output_token_ids == fresh.generate(
        [{"prompt": PROMPTS[1], "params": params}])[0].output_token_ids
    assert again.num_cached_tokens == (first.num_prompt_tokens - 1) // 16 * 16 > 0
    longer = engine.generate([{"prompt": PROMPTS[1] + " Again.", "params": params}])[0]
    assert longer.num_cached_tokens == 0
    assert longer.output_token_ids == transformers_greedy(v32, PROMPTS[1] + " Again.", 8)


def test_the_indexer_keys_cross_the_hand_off(dsa: Path, tmp_path: Path) -> None:
    engine = build(dsa)
    want = engine.generate([{"prompt": PROMPTS[1], "params": greedy(10, ignore_eos=True)}])[0].output_token_ids
    config = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "host"))
    assert tokens_through_handoff(dsa, config, engine, [], PROMPTS[1], greedy(10, ignore_eos=True)) == want


def test_a_decode_step_selects_and_attends_its_resident_sequences_together(dsa: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences of one new row with every block on the device are selected and attended in one batch
    (``dsa_decode_batch``; GLM-5's sharing layers reuse the batch's choice); the answers and the
    ``/strata/stats`` read counters are the per-sequence path's. A sequence whose oldest blocks spilled goes
    the per-sequence way in the same steps, and every answer is still its own."""
    import strata.pipeline.models.attention_dsa as attention_dsa
    requests = [{"prompt": p, "params": greedy(10, ignore_eos=True)} for p in PROMPTS]
    batched: list[int] = []
    decode_sequences = attention_dsa.decode_sequences
    monkeypatch.setattr(attention_dsa, "decode_sequences",
                        lambda meta: batched.append(len(seqs := decode_sequences(meta))) or seqs)
    together = build(dsa)
    answers = [o.output_token_ids for o in together.generate(requests)]
    assert max(batched) == len(PROMPTS)
    long = {"prompt": "Tell me the whole story of the sea and the stars, from the start. " * 12,
            "params": greedy(10, ignore_eos=True)}
    spilling = build(dsa, num_kv_blocks=24, prefill_chunk_tokens=32, host_kv_blocks=300,
                     host_kv_dir=str(tmp_path / "host"))
    mixed = [o.output_token_ids for o in spilling.generate([long] + requests)]
    assert spilling.kv.spills.peak > 0
    monkeypatch.setattr(attention_dsa, "decode_sequences", lambda meta: [])
    alone = build(dsa)
    assert [o.output_token_ids for o in alone.generate(requests)] == answers
    assert together.kv.stats()["sparse_reads"] == alone.kv.stats()["sparse_reads"]
    assert mixed == [build(dsa).generate([r])[0].output_token_ids for r in [long] + requests]


def test_ngram_drafts_select_as_plain_decoding(v32: Path) -> None:
    """A draft row at position p picks its top-k over the p + 1 tokens before it, as one decode step would."""
    from helpers import SPECULATIVE

    requests = [{"prompt": p, "params": greedy(40, ignore_eos=True)} for p in PROMPTS]
    plain = [o.output_token_ids for o in build(v32).generate(requests)]
    engine = build(v32, speculative=SPECULATIVE)
    assert [o.output_token_ids for o in engine.generate(requests)] == plain
    assert engine.core.speculation.drafted > 0


@pytest.mark.slow
def test_tp2_selects_as_tp1(dsa: Path, tmp_path: Path) -> None:
    """Two ranks split MLA's heads and each runs the whole indexer (its weights read whole on every rank), so
    both choose the same tokens: the answers are tp=1's through prefill chunks, and from a tp=2 prefill to a
    tp=1 decode. With older blocks spilled to the host tier every rank loads the same blocks (a load is a
    collective) and keeps the same device copies of spilled indexer keys, the driver deciding for all: what
    was read, from where, and the copies' hits equal tp=1's."""
    requests = [{"prompt": p, "params": greedy(12, ignore_eos=True)} for p in PROMPTS]
    long = [{"prompt": " ".join(["the harbour light"] * 60), "params": greedy(12, ignore_eos=True)}]
    one = build(dsa)
    want = [o.output_token_ids for o in one.generate(requests + long)]
    two = build(dsa, tp=2, prefill_chunk_tokens=16)
    try:
        assert [o.output_token_ids for o in two.generate(requests)] == want[:3]
    finally:
        two.close()
    prefill = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "prefill"), tp=2)
    decode = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "decode"))
    assert tokens_through_handoff(dsa, prefill, one, [], PROMPTS[1], greedy(12, ignore_eos=True),
                                  decode_config=decode) == want[1]
    spilling_one = spilling_engine(dsa, tmp_path / "host-1")
    assert spilling_one.generate(long)[0].output_token_ids == want[3]
    spilling = build(dsa, tp=2, num_kv_blocks=10, prefill_chunk_tokens=32, host_kv_blocks=200,
                     host_kv_dir=str(tmp_path / "host-2"))
    try:
        assert spilling.generate(long)[0].output_token_ids == want[3]
        reads = spilling.kv.stats()["sparse_reads"]
        assert spilling.kv.spills.peak > 4 and 0 < reads["spilled_blocks_read"] < reads["spilled_blocks_seen"]
        assert reads == spilling_one.kv.stats()["sparse_reads"]
        assert spilling.kv.layer_mirror.stats() == spilling_one.kv.layer_mirror.stats()
        assert spilling.kv.layer_mirror.hits > 0
    finally:
        spilling.close()


@pytest.mark.slow
def test_a_tp2_step_abandoned_after_reading_spilled_keys_is_retried_with_the_same_copies(
        v32: Path, tmp_path: Path, monkeypatch) -> None:
    """The driver's forward raises in the very layer whose device copy of spilled indexer keys was just
    extended on every rank (the decision shared, the blocks loaded together). The group abandons the step
    alike, the copies stay the same on both ranks, and the retried step gives tp=1's tokens."""
    from strata.kvstore.layer_mirror import SpilledLayerMirror

    faults = tmp_path / "faults"
    faults.mkdir()
    monkeypatch.setenv("STRATA_FAULT_DIR", str(faults))  # before the group starts: its worker inherits it
    long = [{"prompt": " ".join(["the harbour light"] * 60), "params": greedy(12, ignore_eos=True)}]
    want = spilling_engine(v32, tmp_path / "host-1").generate(long)[0].output_token_ids
    engine = build(v32, tp=2, num_kv_blocks=10, prefill_chunk_tokens=32, host_kv_blocks=200,
                   host_kv_dir=str(tmp_path / "host-2"))
    armed, fired, tokens = faults / "tp_layer.rank0", [], SpilledLayerMirror.tokens

    def arming(self, source, layer: int, num_blocks: int):
        out = tokens(self, source, layer, num_blocks)
        if self.extensions and not fired:  # a copy was just extended: fail this layer on the driver
            armed.write_text("1")
            fired.append(layer)
        return out

    monkeypatch.setattr(SpilledLayerMirror, "tokens", arming)  # the driver's only: the worker is another process
    try:
        out = engine.generate(long)[0]
        group = engine.core.runner.group
        assert fired and not armed.exists(), "the fault fired"
        assert group.abandoned_steps == 1 and group.broken is None
        assert out.error is None and out.output_token_ids == want
        assert engine.healthy()
    finally:
        engine.close()


def test_an_fp8_cache_holds_full_precision_rounded_to_e4m3(dsa: Path, monkeypatch) -> None:
    """``kv_cache_dtype: fp8``: latents and indexer keys are stored as e4m3 over their layer's scale. The logits
    equal a full-precision cache's whose writes are rounded to e4m3 at the same scales and stored widened: the
    scales fold into the queries and the output exactly (powers of two), and the indexer chooses as it would
    over the widened keys (its scores are a power of two apart: the same top-k, ties included)."""
    import strata.pipeline.models.attention_dsa as attention_dsa
    from strata.bringup.teacher_forced import sequence_logits

    fp8 = build(dsa, kv_cache_dtype="fp8")
    assert {t.dtype for t in fp8.kv.device_kv} == {torch.float8_e4m3fn}
    scales: dict[int, float] = {}
    for layer in fp8.core.runner.model.layers:
        attn = layer.self_attn
        scales[attn.layer_idx] = attn.kv_scales[0]
        if attn.runs_indexer:
            scales[attn.index_layer] = attn.index_scale
    assert len(scales) == fp8.kv.layout.num_layers  # a scale per latent layer and per indexer-key layer
    full = build(dsa)
    layer_of = {t.data_ptr(): i for i, t in enumerate(full.kv.device_kv)}
    write = attention_dsa.write_cache

    def rounded(cache: torch.Tensor, values: torch.Tensor, *rest) -> None:
        s = scales[layer_of[cache.data_ptr()]]
        write(cache, (values / s).to(torch.float8_e4m3fn).to(values.dtype) * s, *rest)

    monkeypatch.setattr(attention_dsa, "write_cache", rounded)
    ids = full.tokenizer.tokenizer(PROMPTS[1])["input_ids"]
    want = sequence_logits(full, ids)
    monkeypatch.setattr(attention_dsa, "write_cache", write)
    torch.testing.assert_close(sequence_logits(fp8, ids), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(sequence_logits(full, ids), want, rtol=1e-3, atol=1e-3)  # the rounding shows


def test_what_sparse_attention_cannot_run_with_is_refused_in_one_line(v32: Path) -> None:
    """DeepSeek-V3.2 ships an MTP layer with an indexer of its own, which is not wired: drafting with it is
    refused before the model loads (the tiny checkpoint has no MTP layer, so the check is asked directly)."""
    from strata.pipeline.contract.config import SpeculativeConfig
    from strata.pipeline.models.model_config import load_model_config
    from strata.stages.preflight import check_model_engine

    engine = EngineConfig(speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=1))
    with pytest.raises(ModelConfigError, match="drafts with ngram only"):
        check_model_engine(load_model_config(v32).text, engine)
    check_model_engine(load_model_config(v32).text, EngineConfig(kv_cache_dtype="fp8", tp=2))


class _Spilled:
    """Spilled blocks over fixed values, with the interface ``kvstore.spilled_reads.SpilledBlocks`` offers: what
    the mirror reads from, its loads recorded."""

    def __init__(self, hashes: list[bytes], values: torch.Tensor, segment_blocks: int = 2) -> None:
        self.hashes, self.values, self.segment_blocks, self.block_size = hashes, values, segment_blocks, values.shape[1]
        self.loads: list[tuple[int, int]] = []

    def load(self, layer: int, first_block: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loads.append((first_block, num_blocks))
        part = self.values[first_block : first_block + num_blocks]
        return part, part


def test_the_device_copy_of_spilled_keys_reads_each_block_once_and_never_answers_for_another_prefix() -> None:
    from strata.kvstore.layer_mirror import SpilledLayerMirror

    values = torch.randn(7, 4, 1, 3)  # 7 blocks of 4 tokens
    hashes = [bytes([i]) * 16 for i in range(7)]
    mirror = SpilledLayerMirror(capacity_bytes=7 * 4 * 3 * 4)  # one 7-block copy fits
    first = _Spilled(hashes[:5], values[:5])
    copy, loaded = mirror.tokens(first, 3, 5)
    assert torch.equal(copy, values[:5].reshape(20, 1, 3)) and first.loads == [(0, 2), (2, 2), (4, 1)]
    assert loaded == 5 * 4 * 3 * 4
    assert mirror.tokens(first, 3, 5)[1] == 0 and len(first.loads) == 3  # the same prefix: kept
    grown = _Spilled(hashes, values)
    copy, loaded = mirror.tokens(grown, 3, 7)
    assert grown.loads == [(5, 2)] and loaded == 2 * 4 * 3 * 4 and torch.equal(copy, values.reshape(28, 1, 3))
    other = _Spilled([b"x" * 16] + hashes[1:5], values[:5])  # another first block: another prefix entirely
    assert mirror.tokens(other, 3, 5)[1] == 5 * 4 * 3 * 4
    assert mirror.nbytes <= mirror.capacity_bytes and mirror.stats()["copies"] == 1  # the grown copy was dropped
    assert mirror.tokens(_Spilled(hashes, values), 4, 7)[1] > 0  # another layer is another copy

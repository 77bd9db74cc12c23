"""DeepSeek-V4 in the engine, on a tiny checkpoint built by transformers' own classes: a 16-token window, CSA
layers (4:1, an indexer keeping 4 entries of up to 40) and an HCA layer (16:1) beside a sliding-only one, 4 mHC
streams, hash-routed first layers. Its caches are blocks like every model's (the window, the compressor's
per-token projections and the pooled entries: three kinds of cache group), so chunks, prefix hits, preemption,
spills and hand-offs are the engine's own paths. Greedy tokens against transformers on both backends, `strata ops`
and `strata align` are in test_text_models.py; the components one by one in test_deepseek_v4_parts.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import (SPECULATIVE, assert_preemption_recomputes_the_same, build, greedy, tokens_through_handoff,
                     transformers_greedy)
from strata.pipeline.contract.config import EngineConfig
from strata.pipeline.models.config_errors import ModelConfigError

PROMPTS = ["What is the capital of France? The quick brown fox jumps over the lazy dog.",
           "Tell me about the tides and the moon. " * 4, "A short one."]


@pytest.fixture(scope="module")
def v4(text_models) -> Path:
    return text_models["deepseek_v4"]


def test_the_caches_are_a_window_projections_and_entries(v4: Path) -> None:
    """Entries first (the whole context: 4 rows a block at 4:1 for the two CSA layers, one at 16:1), the CSA layers'
    indexer keys alike, then every layer's 16-token window, then the projections each compression needs until its
    windows close (two windows on CSA: 8 tokens; one on HCA: 16)."""
    layout = build(v4).kv.layout
    csa, hca, keys, window, csa_proj, hca_proj = layout.groups
    assert (csa.compress, csa.rows(16), csa.head_dim, csa.window, csa.layers) == (4, 4, 32, None, (7, 8))
    assert (hca.compress, hca.rows(16), hca.head_dim, hca.layers) == (16, 1, 32, (9,))
    assert (keys.compress, keys.rows(16), keys.head_dim, keys.layers) == (4, 4, 16, (10, 11))
    assert (window.layers, window.window, window.head_dim) == ((0, 1, 2, 3), 16, 32)
    assert (csa_proj.window, csa_proj.head_dim, hca_proj.window, hca_proj.head_dim) == (8, 4 * 32 + 4 * 16, 16, 64)
    assert layout.layer_meta == (1, 1, 1, 1, 2, 2, 3, 0, 0, 0, 0, 0)  # each window group reads its own metadata


@pytest.mark.parametrize("chunk", [5, 16])
def test_prefill_chunks_cut_through_the_compression_windows(chunk: int, v4: Path) -> None:
    engine = build(v4, prefill_chunk_tokens=chunk, max_num_batched_tokens=24, max_num_seqs=4)
    outs = engine.generate([{"prompt": p, "params": greedy(12, ignore_eos=True)} for p in PROMPTS])
    for prompt, out in zip(PROMPTS, outs):
        assert out.output_token_ids == transformers_greedy(v4, prompt, 12), prompt


def test_a_prefix_hit_answers_as_a_fresh_run(v4: Path) -> None:
    """The same prompt again adopts its blocks (entries, and the windows at its end) and answers the same."""
    engine, fresh = build(v4), build(v4)
    params = greedy(8, ignore_eos=True)
    first = engine.generate([{"prompt": PROMPTS[1], "params": params}])[0]
    again = engine.generate([{"prompt": PROMPTS[1], "params": params}])[0]
    assert again.num_cached_tokens == (first.num_prompt_tokens - 1) // 16 * 16 > 0
    assert again.output_token_ids == first.output_token_ids == fresh.generate(
        [{"prompt": PROMPTS[1], "params": params}])[0].output_token_ids


def test_preempted_sequences_recompute_the_same(v4: Path) -> None:
    assert_preemption_recomputes_the_same(v4, PROMPTS)


def test_spilled_entries_are_read_back_from_the_host_tier(v4: Path, tmp_path: Path) -> None:
    """A context four times the device pool: its oldest blocks, and the entries in them, live in the host tier (the
    windows never spill). An HCA layer reads every entry back; a CSA layer reads every indexer key, then only the
    blocks holding an entry its indexer chose (counted as ``/strata/stats`` reports them). A fresh engine over
    the same tier adopts the blocks. Every answer is the all-on-device one."""
    prompt = "Tell me the whole story of the sea and the stars, from the start. " * 12
    expected = build(v4).generate([{"prompt": prompt, "params": greedy(10)}])[0]
    tier = dict(num_kv_blocks=12, prefill_chunk_tokens=32, host_kv_blocks=300, host_kv_dir=str(tmp_path / "host"))
    spilling = build(v4, **tier)
    out = spilling.generate([{"prompt": prompt, "params": greedy(10)}])[0]
    assert out.output_token_ids == expected.output_token_ids
    assert spilling.kv.spills.peak > 8
    reads = spilling.kv.stats()["sparse_reads"]
    assert reads["latent_bytes_spilled"] > 0 and reads["index_key_bytes_spilled"] > 0
    assert 0 < reads["spilled_blocks_read"] < reads["spilled_blocks_seen"]
    again = build(v4, **tier).generate([{"prompt": prompt, "params": greedy(10)}])[0]
    assert again.output_token_ids == expected.output_token_ids and again.num_cached_tokens > 400


def test_a_decode_step_reads_resident_sequences_together_and_spilled_ones_alone(
        v4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences whose blocks are all on the device decode together over padded reads; one whose oldest blocks
    spilled reads them back alone, in the same steps. Each answers as it does by itself."""
    from strata.pipeline.models.v4_paged_step import PagedV4Step
    long = "Tell me the whole story of the sea and the stars, from the start. " * 12
    requests = [{"prompt": p, "params": greedy(10, ignore_eos=True)} for p in [long, *PROMPTS]]
    alone = [build(v4).generate([r])[0].output_token_ids for r in requests]
    seen: list[bool] = []
    batchable = PagedV4Step.batchable
    monkeypatch.setattr(PagedV4Step, "batchable", lambda self, i: seen.append(batchable(self, i)) or seen[-1])
    engine = build(v4, num_kv_blocks=24, prefill_chunk_tokens=32, host_kv_blocks=300,
                   host_kv_dir=str(tmp_path / "host"))
    assert [o.output_token_ids for o in engine.generate(requests)] == alone
    assert engine.kv.spills.peak > 0 and True in seen and False in seen


def test_a_decode_batch_counts_the_reads_the_one_by_one_path_counts(v4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``/strata/stats``' sparse-read counters do not depend on how a step's sequences were read, nor do the
    answers on how many rows a batch may pad (``DECODE_BATCH_VALUES``, which bounds a batch at long contexts)."""
    import strata.pipeline.models.attention_v4 as attention_v4
    from strata.pipeline.models.v4_paged_step import PagedV4Step
    requests = [{"prompt": p, "params": greedy(10, ignore_eos=True)} for p in PROMPTS]
    together = build(v4)
    answers = [o.output_token_ids for o in together.generate(requests)]
    sizes: dict[bool, set[int]] = {True: set(), False: set()}  # by whether the layer has entries, batch sizes
    decode_batch = PagedV4Step.decode_batch

    def recorded(self: PagedV4Step, seqs: list[int]):
        sizes[bool(self.cfg.compress[self.layer])].add(len(seqs))
        return decode_batch(self, seqs)

    monkeypatch.setattr(PagedV4Step, "decode_batch", recorded)
    monkeypatch.setattr(attention_v4, "DECODE_BATCH_VALUES", 1)
    assert [o.output_token_ids for o in build(v4).generate(requests)] == answers
    assert sizes == {True: {1}, False: {len(PROMPTS)}}  # a window-only layer pads no entries
    monkeypatch.setattr(attention_v4, "DECODE_BATCH_VALUES", 1 << 24)
    monkeypatch.setattr(PagedV4Step, "batchable", lambda self, i: False)
    alone = build(v4)
    assert [o.output_token_ids for o in alone.generate(requests)] == answers
    counted = together.kv.stats()["sparse_reads"]
    assert counted == alone.kv.stats()["sparse_reads"] and counted["latent_bytes_device"] > 0


def test_a_spilled_block_lost_mid_request_is_recomputed_not_served(v4: Path, tmp_path: Path) -> None:
    """A spilled block the request still reads (its entries, and on CSA its indexer keys) truncated on the host
    tier and gone from the device: the read finds it corrupt, the sequence is preempted and recomputed, and the
    answer is the all-on-device one."""
    prompt = "Tell me the whole story of the sea and the stars, from the start. " * 12
    expected = build(v4).generate([{"prompt": prompt, "params": greedy(10, ignore_eos=True)}])[0]
    engine = build(v4, num_kv_blocks=12, prefill_chunk_tokens=32, host_kv_blocks=300,
                   host_kv_dir=str(tmp_path / "host"))
    rid = engine.add_request(prompt=prompt, params=greedy(10, ignore_eos=True))
    host, damaged, tokens = engine.kv.lower.top, False, []
    while engine.has_unfinished():
        tokens += [o.token_id for o in engine.step() if o.request_id == rid]
        seq = engine._requests.get(rid)
        if not damaged and seq is not None and seq.block_table.num_spilled > 4:
            lost = seq.block_hashes[1]
            path = Path(host.files.path(lost))
            path.write_bytes(path.read_bytes()[:-8])
            pool = engine.kv.pool
            if (victim := pool.lookup(lost)) is not None:  # the device cannot serve it either
                pool._by_hash.pop(lost)
                pool._hash[victim] = None
            damaged = True
    assert damaged and host.counters["corrupt"] >= 1
    assert engine.core.scheduler.num_preemptions >= 1
    assert tokens == expected.output_token_ids


def test_the_hand_off_carries_every_cache(v4: Path, tmp_path: Path) -> None:
    engine = build(v4)
    want = engine.generate([{"prompt": PROMPTS[1], "params": greedy(10, ignore_eos=True)}])[0].output_token_ids
    config = EngineConfig(host_kv_blocks=256, host_kv_dir=str(tmp_path / "host"))
    assert tokens_through_handoff(v4, config, engine, [], PROMPTS[1], greedy(10, ignore_eos=True)) == want


def test_ngram_drafts_answer_as_plain_decoding(v4: Path) -> None:
    """A rejected draft wrote KV, projections and perhaps an entry past the accepted tokens: each is written again
    when its position is computed again, and never read before."""
    requests = [{"prompt": p, "params": greedy(40, ignore_eos=True)} for p in PROMPTS]
    plain = [o.output_token_ids for o in build(v4).generate(requests)]
    engine = build(v4, speculative=SPECULATIVE)
    assert [o.output_token_ids for o in engine.generate(requests)] == plain
    assert engine.core.speculation.drafted > 0


@pytest.mark.slow
def test_tp2_equals_tp1(v4: Path, tmp_path: Path) -> None:
    """Two ranks split the q heads and the output groups (one each) and the experts; each pools and chooses the
    same entries, so every answer is tp=1's, through prefill chunks and a batch, and with a context spilled to a
    host tier (every rank loads the same chosen blocks and keeps the same device copies, the driver deciding)."""
    requests = [{"prompt": p, "params": greedy(12, ignore_eos=True)} for p in PROMPTS]
    long = [{"prompt": "Tell me the whole story of the sea and the stars, from the start. " * 12,
             "params": greedy(10)}]
    expected = [o.output_token_ids for o in build(v4).generate(requests + long)]
    two = build(v4, tp=2, prefill_chunk_tokens=5, max_num_batched_tokens=24, max_num_seqs=4)
    try:
        assert [o.output_token_ids for o in two.generate(requests)] == expected[:3]
    finally:
        two.close()
    spilling = build(v4, tp=2, num_kv_blocks=12, prefill_chunk_tokens=32, host_kv_blocks=300,
                     host_kv_dir=str(tmp_path / "host"))
    try:
        assert spilling.generate(long)[0].output_token_ids == expected[3]
        assert spilling.kv.spills.peak > 8 and spilling.kv.layer_mirror.stats()["copies"] > 0
    finally:
        spilling.close()


@pytest.mark.parametrize("setting, words", [
    (dict(compile=True), "eager"), (dict(speculative={"method": "mtp", "num_speculative_tokens": 1}), "use ngram")])
def test_what_it_does_not_run_with_yet_is_refused_in_one_line(setting: dict, words: str, v4: Path) -> None:
    with pytest.raises(ModelConfigError, match=words):
        build(v4, **setting)


def test_an_fp8_cache_holds_full_precision_rounded_to_e4m3(v4: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``kv_cache_dtype: fp8``: the window's K=V, the projections, the entries and the indexer keys are stored as
    e4m3 over their KV-layout layer's scale, every read widened. The logits equal a full-precision cache's whose
    writes are rounded to e4m3 at the same scales. With a context four times the device pool, the blocks read
    back from the host tier and the device's copies of spilled keys widen alike: the answer is the all-on-device
    FP8 cache's. Two ranks (each calibrating its replicated caches) answer as one."""
    from strata.bringup.teacher_forced import sequence_logits
    from strata.pipeline.models.v4_paged_cache import V4CacheFormat

    fp8 = build(v4, kv_cache_dtype="fp8")
    assert {t.dtype for t in fp8.kv.device_kv} == {torch.float8_e4m3fn}
    scales = fp8.core.runner.model.layers[0].layout_scales
    assert len(scales) == fp8.kv.layout.num_layers and len(set(scales)) > 1  # a scale of its own per layer
    full = build(v4)
    store = V4CacheFormat.store

    def rounded(self: V4CacheFormat, layer: int, values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
        e4m3 = (values.float() / scales[layer]).clamp(-448, 448).to(torch.float8_e4m3fn)
        return (e4m3.float() * scales[layer]).to(cache_dtype)

    ids = full.tokenizer.tokenizer(PROMPTS[1])["input_ids"]
    plain = sequence_logits(full, ids)
    monkeypatch.setattr(V4CacheFormat, "store", rounded)
    want = sequence_logits(full, ids)
    monkeypatch.setattr(V4CacheFormat, "store", store)
    torch.testing.assert_close(sequence_logits(fp8, ids), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, want, rtol=1e-3, atol=1e-3)  # the rounding shows

    prompt = "Tell me the whole story of the sea and the stars, from the start. " * 12
    expected = fp8.generate([{"prompt": prompt, "params": greedy(10, ignore_eos=True)}])[0].output_token_ids
    spilling = build(v4, kv_cache_dtype="fp8", num_kv_blocks=12, prefill_chunk_tokens=32, host_kv_blocks=300,
                     host_kv_dir=str(tmp_path / "host"))
    got = spilling.generate([{"prompt": prompt, "params": greedy(10, ignore_eos=True)}])[0].output_token_ids
    assert got == expected
    assert spilling.kv.spills.peak > 8 and spilling.kv.stats()["sparse_reads"]["latent_bytes_spilled"] > 0
    requests = [{"prompt": p, "params": greedy(12, ignore_eos=True)} for p in PROMPTS]
    two = build(v4, tp=2, kv_cache_dtype="fp8", prefill_chunk_tokens=5, max_num_batched_tokens=24, max_num_seqs=4)
    try:
        assert [o.output_token_ids for o in two.generate(requests)] == [
            o.output_token_ids for o in fp8.generate(requests)]
    finally:
        two.close()


def test_the_planner_counts_what_the_engine_caches(v4: Path) -> None:
    """Per block the planner counts the pooled entries (the groups that grow with the context), and per sequence
    the windows: the engine's layout holds the same bytes."""
    from strata.pipeline.models.model_config import load_model_config
    from strata.planning.kv_bytes import compressed_windows, kv_bytes_per_block

    layout = build(v4).kv.layout
    tc = load_model_config(v4).text
    growing = sum(g.layer_nbytes(16) * g.num_layers for g in layout.groups if g.window is None)
    assert kv_bytes_per_block(tc, 4, 16) == growing == 2 * 4 * (32 + 16) * 4 + 1 * 32 * 4
    windows = {(g.window, g.head_dim, g.num_layers) for g in layout.groups if g.window is not None}
    assert windows == set(compressed_windows(tc))


def test_a_million_tokens_of_v4_flash_cost_a_thirteenth_of_v32s() -> None:
    """DeepSeek-V4-Flash at its real shape (transformers' defaults): 284B parameters as DeepSeek counts them; per
    token 20 CSA layers keep a quarter of a 512 + 128-value entry and 23 HCA layers 1/128 of a 512-value one, where
    DeepSeek-V3.2 keeps 61 latents and indexer keys whole. 128-token blocks hold HCA entries without waste; a
    16-token block still holds one row of each."""
    from strata.planning.memory_plan import plan_memory

    GiB = 1 << 30
    v4 = plan_memory("deepseek-v4-flash", 1_000_000, 1, 80 * GiB, block_size=128)
    v32 = plan_memory("deepseek-v3.2", 1_000_000, 1, 80 * GiB, block_size=128)
    assert v4.num_params == pytest.approx(284e9, rel=0.005)
    assert v4.kv_bytes_per_token == 20 * 640 * 2 // 4 + 23 * 512 * 2 // 128 == 6584
    assert v32.kv_bytes_per_token == 61 * (576 + 128) * 2 > 13 * v4.kv_bytes_per_token
    small = plan_memory("deepseek-v4-flash", 1_000_000, 1, 80 * GiB, block_size=16)
    assert small.bytes_per_block == 20 * 4 * 640 * 2 + 23 * 512 * 2
    whole, chosen = v4.sparse_step  # each decode step: every indexer key and HCA entry; the chosen CSA entries, windows
    assert whole == (20 * (1_000_000 // 4) * 128 + 23 * (1_000_000 // 128) * 512) * 2
    assert chosen == (20 * 512 + 43 * 128) * 512 * 2


def test_a_block_size_the_compression_does_not_divide_is_refused(v4: Path) -> None:
    """16-token entries cannot be placed in 24-token blocks (nor 24 in 16): a clear error, not a misplaced row."""
    with pytest.raises(ValueError, match="block_size 24 and a group compressed 16:1 must divide one another"):
        build(v4, block_size=24)

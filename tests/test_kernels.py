"""Kernels against dense references: paged attention vs SDPA, LSE merge, norm, RoPE, MoE."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import (
    AttentionMetadata,
    RotaryEmbedding,
    apply_rope,
    available_backends,
    dense_attention,
    get_attention_backend,
    merge_attention_states,
    moe_experts,
    moe_route,
    rms_norm,
    rotate_heads,
    segment_attention,
    signed_sin,
    write_cache,
    write_kv,
)
from strata.kernels.attention_torch import attend_with_positions

from helpers import BS, dense_reference as _dense_reference, paged_batch


BACKENDS = available_backends("cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_lse", [True, False], ids=["lse", "fused"])
@pytest.mark.parametrize("window", [None, 5, 23])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 1)])
def test_paged_attention_equals_dense_sdpa(hq: int, hkv: int, window: int | None, with_lse: bool, backend: str) -> None:
    gen = torch.Generator().manual_seed(hq * 10 + hkv + (window or 0))
    d = 16
    # Not multiples of the block size; decodes, short chunks, long chunks (the flash path), a chunk after context.
    seq_lens = [1, 17, 33, 50, 64, 7, 90, 40]
    query_lens = [1, 17, 1, 19, 5, 1, 45, 40]
    k_cache, v_cache, dense, meta = paged_batch(seq_lens, query_lens, hkv, d, 60, gen)
    q = torch.randn(sum(query_lens), hq, d, generator=gen)
    scale = d**-0.5
    out, lse = get_attention_backend(backend).forward(q, k_cache, v_cache, meta, scale, window, return_lse=with_lse)
    start = 0
    for (k, v), s_len, q_len in zip(dense, seq_lens, query_lens):
        q_pos = torch.arange(s_len - q_len, s_len)
        ref = _dense_reference(q[start : start + q_len], k, v, q_pos, window)
        torch.testing.assert_close(out[start : start + q_len], ref, rtol=1e-5, atol=1e-5)
        start += q_len
    assert (lse is not None) == with_lse
    if with_lse:
        assert torch.isfinite(lse).all()
        ref_out, ref_lse = get_attention_backend("torch").forward(q, k_cache, v_cache, meta, scale, window, return_lse=True)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the C++ CPU kernel did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("threads,seq_lens", [(2, [13_001]), (4, [13_001]), (4, [13_001, 5_000])],
                         ids=["2-parts", "3-parts", "beside-one-too-short"])
def test_a_long_decode_split_over_threads_equals_the_reference(threads: int, seq_lens: list[int],
                                                               dtype: torch.dtype) -> None:
    """Fewer decodes than threads: the C++ kernel splits each long one's keys into parts of at least 4,096,
    one per thread, and merges them by log-sum-exp (flash-decoding). Output and lse equal the torch
    reference's: a lone decode in 2 or 3 parts, and one in 2 parts beside one too short to split."""
    gen = torch.Generator().manual_seed(threads + len(seq_lens))
    query_lens = [1] * len(seq_lens)
    k_cache, v_cache, _, meta = paged_batch(seq_lens, query_lens, 2, 64, 1200, gen)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(sum(query_lens), 8, 64, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = get_attention_backend("cpu").forward(q, k_cache, v_cache, meta, 0.125, None, return_lse=True)
        fused, _ = get_attention_backend("cpu").forward(q, k_cache, v_cache, meta, 0.125, None, return_lse=False)
    finally:
        torch.set_num_threads(before)
    want, want_lse = get_attention_backend("torch").forward(q, k_cache.float(), v_cache.float(), meta, 0.125, None,
                                                            return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, out, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("latent_dim", [40, 576], ids=["tiny-latent", "deepseek-latent"])
def test_mla_latent_as_keys_and_values(backend: str, latent_dim: int, dtype: torch.dtype) -> None:
    """MLA's absorbed attention: one latent tensor is both the keys and (its first columns carry) the
    values; every backend takes the same tensor twice. Decodes and a short prompt (16 heads on one KV
    head: the CPU backend's GEMM path) and a long chunk after context (the flash path), against dense
    SDPA on the latent."""
    gen = torch.Generator().manual_seed(latent_dim)
    hq, num_blocks = 16, 40
    seq_lens, query_lens = [1, 30, 70, 100], [1, 30, 1, 40]
    latent = torch.zeros(num_blocks, BS, 1, latent_dim)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, dense, slots = [], [], []
    for n, ql in zip(seq_lens, query_lens):
        blocks = [perm.pop() for _ in range(-(-n // BS))]
        values = torch.randn(n, 1, latent_dim, generator=gen)
        all_slots = torch.tensor([blocks[i // BS] * BS + i % BS for i in range(n)])
        write_cache(latent, values, all_slots)
        tables.append(blocks)
        dense.append(values.to(dtype).float())
        slots.extend(all_slots[n - ql:].tolist())
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, BS)
    q = torch.randn(sum(query_lens), hq, latent_dim, generator=gen).to(dtype)
    cache = latent.to(dtype)
    scale = 0.07
    out, lse = get_attention_backend(backend).forward(q, cache, cache, meta, scale, None, return_lse=True)
    start = 0
    for kv, n, ql in zip(dense, seq_lens, query_lens):
        ref = _dense_reference(q[start : start + ql].float() * (scale / latent_dim**-0.5), kv, kv,
                               torch.arange(n - ql, n), None)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[start : start + ql].float(), ref, rtol=tol, atol=tol)
        start += ql
    _, ref_lse = get_attention_backend("torch").forward(q, cache, cache, meta, scale, None, return_lse=True)
    # the tier path merges by it; a bf16 cache's scores round to bf16 before the softmax (as in its GEMMs)
    lse_tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(lse, ref_lse, rtol=lse_tol, atol=lse_tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (24, 16), (16, 8)], ids=["vector", "odd-dim", "small-block"])
def test_backends_agree_on_bf16_caches_and_other_shapes(backend: str, head_dim: int, block_size: int) -> None:
    """bf16 KV (the kernel widens it) and shapes off the vector path; the torch backend is the oracle."""
    gen = torch.Generator().manual_seed(head_dim + block_size)
    hq, hkv, num_blocks = 8, 2, 48
    seq_lens, query_lens = [5, 70, 36, 120], [1, 1, 36, 50]
    pool = torch.randn(num_blocks, 2, 2, block_size, hkv, head_dim, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    slots = [s for t, n, ql in zip(tables, seq_lens, query_lens)
             for s in (t[p // block_size] * block_size + p % block_size for p in range(n - ql, n))]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, block_size)
    q = torch.randn(sum(query_lens), hq, head_dim, generator=gen).to(torch.bfloat16)
    k, v = pool[:, 1, 0], pool[:, 1, 1]
    ref, ref_lse = get_attention_backend("torch").forward(q, k, v, meta, 0.1, None, return_lse=True)
    out, lse = get_attention_backend(backend).forward(q, k, v, meta, 0.1, None, return_lse=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_auto_prefers_the_fast_backend_when_it_builds() -> None:
    from strata.kernels.cpu_kernels import cpu_kernels, unavailable_reason

    assert BACKENDS[-1] == "torch"
    if cpu_kernels() is None:
        pytest.skip(f"CPU kernels not built here: {unavailable_reason()}")
    assert get_attention_backend("auto").name == "cpu"


def test_lse_merge_of_two_halves_equals_whole() -> None:
    gen = torch.Generator().manual_seed(0)
    tq, s, hq, hkv, d = 9, 70, 8, 2, 32
    q = torch.randn(1, tq, hq, d, generator=gen)
    k = torch.randn(1, s, hkv, d, generator=gen)
    v = torch.randn(1, s, hkv, d, generator=gen)
    q_pos = torch.arange(s - tq, s)[None]
    k_pos = torch.arange(s)[None]
    valid = torch.ones(1, s, dtype=torch.bool)
    whole, whole_lse = attend_with_positions(q, k, v, q_pos, k_pos, valid, 0.2, None)
    split = 37
    a, lse_a = attend_with_positions(q, k[:, :split], v[:, :split], q_pos, k_pos[:, :split], valid[:, :split], 0.2, None)
    b, lse_b = attend_with_positions(q, k[:, split:], v[:, split:], q_pos, k_pos[:, split:], valid[:, split:], 0.2, None)
    merged, merged_lse = merge_attention_states(a[0], lse_a[0], b[0], lse_b[0])
    torch.testing.assert_close(merged, whole[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged_lse, whole_lse[0], rtol=1e-5, atol=1e-6)


def test_merge_with_an_empty_segment_is_identity() -> None:
    out = torch.randn(3, 2, 4)
    lse = torch.randn(3, 2)
    empty_lse = torch.full((3, 2), float("-inf"))
    merged, merged_lse = merge_attention_states(out, lse, torch.zeros_like(out), empty_lse)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    ref.weight.data = (torch.rand(64) + 0.5).to(dtype)
    x = (torch.randn(10, 64) * 3).to(dtype)
    torch.testing.assert_close(rms_norm(x, ref.weight, 1e-5), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotating_q_and_k_heads_together_is_bit_identical(partial: float) -> None:
    q, k = torch.randn(9, 8, 64), torch.randn(9, 4, 64)
    rope = RotaryEmbedding(64, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": partial})
    cos, sin = rope.cos_sin(torch.arange(9) * 37, torch.float32)
    q_ref, k_ref = apply_rope(q, k, cos, sin)
    qk = rotate_heads(torch.cat([q, k], dim=1), cos, signed_sin(sin))
    assert torch.equal(qk[:, :8], q_ref) and torch.equal(qk[:, 8:], k_ref)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ],
)
def test_rope_matches_transformers(params: dict) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=params, max_position_embeddings=4096)
    ref = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 5, 100, 3000])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    cos_r, sin_r = ref(q, pos[None])
    q_r, k_r = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_r, sin_r)
    ours = RotaryEmbedding(16, params)
    cos, sin = ours.cos_sin(pos, torch.float32)
    q_o, k_o = apply_rope(q, k, cos, sin)
    torch.testing.assert_close(q_o, q_r[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_o, k_r[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_partial_rope_matches_glm4_moe() -> None:
    """GLM-4.5 rotates the first half of each head and passes the rest through (its own classes as the reference)."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    cfg = Glm4MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=params)
    pos = torch.tensor([0, 1, 5, 100, 3000])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    cos_r, sin_r = Glm4MoeRotaryEmbedding(cfg)(q, pos[None])
    q_r, k_r = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_r, sin_r)
    cos, sin = RotaryEmbedding(16, params).cos_sin(pos, torch.float32)
    assert cos.shape == (5, 8)
    q_o, k_o = apply_rope(q, k, cos, sin)
    torch.testing.assert_close(q_o, q_r[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_o, k_r[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(q_o[..., 8:], q[..., 8:])  # the unrotated half passes through


@pytest.mark.parametrize("interleaved", [False, True], ids=["qwen2.5-vl-runs", "qwen3-vl-interleaved"])
def test_mrope_matches_transformers(interleaved: bool) -> None:
    """3-D positions (temporal, height, width) that differ per axis, as an image's tokens have: each frequency
    reads the axis its M-RoPE section gives it, exactly as transformers' Qwen-VL text rotary embeddings."""
    if interleaved:
        from transformers import Qwen3VLTextConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Reference
    else:
        from transformers import Qwen2_5_VLTextConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding as Reference
    section = [8, 12, 12]  # of 32 frequencies (head dim 64), as the real models' 16/24/24 of 64 scaled down
    params = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": section}
    ref = Reference(Config(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=params))
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 5000, (3, 7), generator=gen)
    cos_r, sin_r = ref(torch.zeros(1, 7, 64), pos[:, None])
    cos, sin = RotaryEmbedding(64, params, tuple(section), interleaved).cos_sin(pos, torch.float32)
    torch.testing.assert_close(cos, cos_r[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, sin_r[0], rtol=0, atol=1e-6)
    text = pos[0].repeat(3, 1)  # a text token's three positions are equal: plain RoPE
    torch.testing.assert_close(RotaryEmbedding(64, params, tuple(section), interleaved).cos_sin(text, torch.float32)[0],
                               RotaryEmbedding(64, params).cos_sin(pos[0], torch.float32)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="mrope_section"):
        RotaryEmbedding(64, params, (8, 12, 10))


def test_segment_attention_equals_attention_segment_by_segment() -> None:
    """Packed images or windows of several lengths, grouped by length into batches: each segment attends
    only to itself, exactly as one dense call per segment."""
    gen = torch.Generator().manual_seed(0)
    lengths = [16, 5, 16, 0, 9, 5, 16]
    q, k, v = (torch.randn(sum(lengths), 4, 8, generator=gen) for _ in range(3))
    out = segment_attention(q, k, v, lengths, 8**-0.5)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        ref = dense_attention(q[sl].transpose(0, 1)[None], k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None],
                              8**-0.5)[0].transpose(0, 1)
        torch.testing.assert_close(out[sl], ref, rtol=1e-6, atol=1e-6)
        start += n


def test_unsupported_rope_type_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported rope_type"):
        RotaryEmbedding(16, {"rope_type": "longrope", "rope_theta": 1e4})


@pytest.mark.parametrize("mscale", [None, 1.0, 0.707])
def test_yarn_rope_matches_transformers(mscale) -> None:
    """YaRN frequencies and cos/sin scale, DeepSeek-V3's way (mscale / mscale_all_dim) and the plain way."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    params = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
              "beta_slow": 1, "rope_theta": 10000.0}
    if mscale is not None:
        params.update(mscale=mscale, mscale_all_dim=1.0)
    reference = DeepseekV3RotaryEmbedding(DeepseekV3Config(rope_parameters=dict(params), qk_rope_head_dim=64,
                                                           max_position_embeddings=163840))
    positions = torch.arange(0, 160000, 1013)
    ref_cos, ref_sin = reference(torch.zeros(1), positions[None])
    ours = RotaryEmbedding(64, params)
    cos, sin = ours.cos_sin(positions, torch.float32)
    assert ours.attention_scaling == pytest.approx(reference.attention_scaling)
    assert ours.attention_scaling != 1.0 or mscale == 1.0
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=0)


def test_grouped_routing_matches_deepseek_router() -> None:
    """Sigmoid scores, bias-corrected group-limited top-k, renormalised and scaled: DeepSeek-V3's router."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from strata.kernels import moe_route_grouped

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen))
    x = torch.randn(50, 32, generator=gen)
    _, ref_w, ref_ids = router(x)
    w, ids = moe_route_grouped(x @ router.weight.T, router.e_score_correction_bias, 4, 4, 2, True, 2.5)
    order, ref_order = ids.sort(-1).indices, ref_ids.sort(-1).indices
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)
    groups = (ids // 4)
    assert all(len(set(row.tolist())) <= 2 for row in groups)  # only topk_group groups are eligible


def test_moe_matches_mixtral_block() -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2)
    ref = MixtralSparseMoeBlock(cfg).eval()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 23, 32)
    weights, ids = moe_route(F.linear(x[0], ref.gate.weight), 2)
    ours = moe_experts(x[0], ref.experts.gate_up_proj, ref.experts.down_proj, weights, ids)
    with torch.no_grad():
        torch.testing.assert_close(ours, ref(x)[0], rtol=1e-5, atol=1e-5)
    assert math.isclose(weights.sum(-1).mean().item(), 1.0, rel_tol=1e-6)


def test_unknown_or_unusable_backends_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash")
    for name in ("flashinfer", "vllm_flash_attn", "triton"):  # CUDA-only here (no GPU, no interpreter)
        with pytest.raises(ValueError, match="cannot run on cpu"):
            get_attention_backend(name, "cpu")
    assert "triton" not in available_backends("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_linear_result_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    """Bit for bit, for every batch the streaming kernel takes: a token decoded alone, in a batch, or in a
    speculative draft gets the same projections (so fp32 greedy answers do not depend on the batch)."""
    from strata.kernels import linear

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 200, generator=gen).to(dtype)
    w = torch.randn(96, 200, generator=gen).to(dtype)
    alone = torch.cat([linear(x[r : r + 1], w) for r in range(8)])
    for rows in range(2, 9):
        assert torch.equal(linear(x[:rows], w), alone[:rows]), rows
    if dtype == torch.float32:  # the C++ GEMM past 8 rows: a row's bits the same among 9 as among 64
        many = torch.randn(64, 200, generator=gen)
        assert torch.equal(linear(many[:9], w), linear(many, w)[:9])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17, 64, 65])
@pytest.mark.parametrize("k", [64, 200, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_torch_for_every_batch_size_and_shape(rows: int, k: int, dtype: torch.dtype) -> None:
    """The streaming kernel (<= 8 rows), the C++ GEMM (fp32, 9 to 64 rows: one and two vectors of x^T a pass)
    and torch's GEMM (more) all equal F.linear, bias included."""
    from strata.kernels import linear

    gen = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(96, k, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    out = linear(x, w, b)
    assert out.dtype == dtype and out.shape == (rows, 96)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref if dtype == torch.float32 else ref.to(dtype).float(), rtol=tol, atol=tol * 4)
    torch.testing.assert_close(linear(x, w).float(), F.linear(x.float(), w.float()).to(dtype).float(), rtol=tol, atol=tol * 4)

"""DeepSeek-V4's components against transformers' own modules, fed the same weights and inputs.

Bring-up of a new architecture starts layer by layer: the mHC streams, the sqrt-softplus and hash routers,
the clamped experts, the KV compressors (pooling, norm, interleaved tail RoPE) and the grouped output
projection each equal ``transformers.models.deepseek_v4`` in fp32, and stay close in bf16.
"""

from __future__ import annotations

import pytest
import torch

torch.set_grad_enabled(False)
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ref

from strata.kernels.compress_kv import pool_windows, rms_norm_fp32_weight, rope_tail, tail_rope_cos_sin
from strata.kernels.layer_ops import clamped_silu_mul
from strata.kernels.moe import moe_route_sqrtsoftplus
from strata.pipeline.models.hyper_connections import HyperConnection, HyperHead, expand

HC, HIDDEN = 4, 32


def _config() -> DeepseekV4Config:
    return DeepseekV4Config(vocab_size=64, hidden_size=HIDDEN, moe_intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=4, head_dim=16, q_lora_rank=24, n_routed_experts=8,
                            num_experts_per_tok=2, sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=2,
                            index_head_dim=8, index_topk=3, hc_mult=HC, partial_rotary_factor=0.5,
                            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                            num_nextn_predict_layers=0)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hyper_connections_equal_the_reference(dtype: torch.dtype) -> None:
    cfg = _config()
    theirs = ref.DeepseekV4HyperConnection(cfg).float()
    _randomize(theirs, 0)
    ours = HyperConnection(HC, HIDDEN, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict(theirs.state_dict())
    streams = torch.randn(6, HC, HIDDEN).to(dtype)
    post, comb, collapsed = ours(streams)
    t_post, t_comb, t_collapsed = theirs(streams.unsqueeze(0))
    torch.testing.assert_close(post, t_post[0], rtol=0, atol=0)
    torch.testing.assert_close(comb, t_comb[0], rtol=0, atol=0)
    torch.testing.assert_close(collapsed, t_collapsed[0], rtol=0, atol=0)
    assert torch.allclose(comb.sum(-2), torch.ones(6, HC), atol=1e-5)  # Sinkhorn ends on the columns
    out = torch.randn(6, HIDDEN).to(dtype)
    expected = t_post.to(dtype).unsqueeze(-1) * out.unsqueeze(0).unsqueeze(-2) + torch.matmul(
        t_comb.to(dtype).transpose(-1, -2), streams.unsqueeze(0))
    torch.testing.assert_close(expand(streams, out, post, comb), expected[0], rtol=0, atol=0)

    head_ref = ref.DeepseekV4HyperHead(cfg).float()
    _randomize(head_ref, 1)
    head = HyperHead(HC, HIDDEN, cfg.hc_eps, cfg.rms_norm_eps)
    head.load_state_dict(head_ref.state_dict())
    torch.testing.assert_close(head(streams), head_ref(streams.unsqueeze(0))[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sqrt_softplus_and_hash_routing_equal_the_reference(dtype: torch.dtype) -> None:
    cfg = _config()
    x = torch.randn(10, HIDDEN).to(dtype)
    topk = ref.DeepseekV4TopKRouter(cfg).to(dtype)
    _randomize(topk, 2)
    topk.e_score_correction_bias.copy_(torch.randn(8))
    _, t_weights, t_ids = topk(x)
    weights, ids = moe_route_sqrtsoftplus(torch.nn.functional.linear(x, topk.weight), topk.e_score_correction_bias,
                                          2, cfg.routed_scaling_factor)
    assert torch.equal(ids, t_ids)
    torch.testing.assert_close(weights, t_weights.float(), rtol=0, atol=0)

    hashed = ref.DeepseekV4HashRouter(cfg).to(dtype)
    _randomize(hashed, 3)
    hashed.tid2eid.copy_(torch.randint(0, 8, hashed.tid2eid.shape, generator=torch.Generator().manual_seed(4)))
    token_ids = torch.randint(0, 64, (10,))
    _, t_weights, t_ids = hashed(x, token_ids)
    weights, ids = moe_route_sqrtsoftplus(torch.nn.functional.linear(x, hashed.weight), None, 2,
                                          cfg.routed_scaling_factor, hashed.tid2eid[token_ids])
    assert torch.equal(ids, t_ids)
    torch.testing.assert_close(weights, t_weights.float(), rtol=0, atol=0)


def test_clamped_experts_equal_the_reference() -> None:
    cfg = _config()
    experts = ref.DeepseekV4Experts(cfg)
    gate_up = torch.randn(5, 32) * 8  # past the clamp of 10 on both sides
    torch.testing.assert_close(clamped_silu_mul(gate_up, cfg.swiglu_limit), experts._apply_gate(gate_up),
                               rtol=0, atol=0)


def _compressor_by_hand(comp: torch.nn.Module, h: torch.Tensor, overlap: bool, cfg: DeepseekV4Config,
                        chunks: list[int]) -> torch.Tensor:
    """Every entry of ``h``'s closed windows, pooled from projections as the engine keeps them (the windows and
    the one before them), chunk by chunk: each entry computed once, by the chunk holding its window's last token."""
    m = comp.compress_rate
    pieces = torch.split(h, chunks)  # projected chunk by chunk, as the engine's steps do
    kv = torch.cat([comp.kv_proj(p) for p in pieces])
    gate = torch.cat([comp.gate_proj(p) for p in pieces])
    rope = ref.DeepseekV4RotaryEmbedding(cfg)
    inv_freq = rope.compress_inv_freq
    entries, done, end = [], 0, 0
    for n in chunks:  # the windows a chunk closes are pooled at once, as the reference pools them
        end += n
        closed = end // m
        if closed > done:
            width = kv.shape[-1]
            windows = slice(done * m, closed * m)
            prior = slice((done - 1) * m, done * m) if (overlap and done) else None
            pooled = pool_windows(kv[windows].view(-1, m, width), gate[windows].view(-1, m, width), comp.position_bias,
                                  overlap, kv[prior] if prior else None, gate[prior] if prior else None)
            normed = rms_norm_fp32_weight(pooled, comp.kv_norm.weight, comp.kv_norm.variance_epsilon)
            cos, sin = tail_rope_cos_sin(inv_freq, 1.0, torch.arange(done, closed) * m, normed.dtype)
            entries.append(rope_tail(normed, cos, sin))
        done = closed
    return torch.cat(entries)


@pytest.mark.parametrize("kind", ["hca", "csa", "indexer"])
def test_compressed_entries_equal_the_reference_chunk_by_chunk(kind: str) -> None:
    """The reference carries a buffer and the last window's first half across calls; the engine recomputes an
    entry from the projections of its window and the one before. Chunk edges fall inside windows."""
    cfg = _config()
    torch.manual_seed(5)
    comp = {"hca": ref.DeepseekV4HCACompressor, "csa": ref.DeepseekV4CSACompressor,
            "indexer": ref.DeepseekV4Indexer}[kind](cfg).float()
    _randomize(comp, 6)
    h = torch.randn(1, 29, HIDDEN)
    cache = ref.DynamicCache(config=DeepseekV4Config(**{**cfg.to_dict(), "layer_types": (
        ["heavily_compressed_attention"] if kind == "hca" else ["compressed_sparse_attention"]) * 2}))
    chunks, start, name = [3, 7, 1, 9, 9], 0, "indexer" if kind == "indexer" else "compressor"
    q_res = torch.randn(1, 29, cfg.q_lora_rank)
    for n in chunks:
        rows = slice(start, start + n)
        positions = torch.arange(start, start + n).unsqueeze(0)
        comp(h[:, rows], q_res[:, rows], positions, cache, 0)
        start += n
    theirs = cache.layers[0].compressed_kv[name][0]
    ours = _compressor_by_hand(comp, h[0], kind != "hca", cfg, chunks)
    assert ours.shape == theirs.shape == (29 // comp.compress_rate, comp.head_dim)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_closing_windows_pooled_together_equal_each_alone(overlap: bool, dtype: torch.dtype) -> None:
    """A decode step pools the windows its sequences' rows close in one call: each entry bit for bit what
    pooling its window alone gives, a sequence's first window (no Ca before it) among later ones. (At the
    widths models have: torch's softmax over dim 1 of 16-wide rows is not batch invariant in fp32.)"""
    from strata.kernels.compress_kv import pool_each_window

    torch.manual_seed(7)
    m, width, windows = 4, 2 * 32 if overlap else 32, 5
    kv, gate, prior_kv, prior_gate = (torch.randn(windows, m, width).to(dtype) for _ in range(4))
    bias = torch.randn(m, width)
    has_prior = torch.tensor([True, False, True, True, False]) & overlap
    together = pool_each_window(kv, gate, bias, overlap, prior_kv, prior_gate, has_prior)
    for w in range(windows):
        prior = (prior_kv[w], prior_gate[w]) if has_prior[w] else (None, None)
        alone = pool_windows(kv[w : w + 1], gate[w : w + 1], bias, overlap, *prior)
        assert torch.equal(together[w : w + 1], alone), w


def test_tail_rope_and_its_inverse_equal_the_reference() -> None:
    cfg = _config()
    rope = ref.DeepseekV4RotaryEmbedding(cfg)
    x = torch.randn(5, 3, 16)
    positions = torch.tensor([0, 1, 7, 100, 4095])
    t_cos, t_sin = rope(x, positions.unsqueeze(0), layer_type="main")
    cos, sin = tail_rope_cos_sin(rope.main_inv_freq, rope.main_attention_scaling, positions, x.dtype)
    expected = ref.apply_rotary_pos_emb(x.unsqueeze(0).transpose(1, 2), t_cos, t_sin).transpose(1, 2)[0]
    torch.testing.assert_close(rope_tail(x, cos, sin), expected, rtol=0, atol=0)
    torch.testing.assert_close(rope_tail(rope_tail(x, cos, sin), cos, -sin), x, rtol=1e-5, atol=1e-5)


class SequenceCache:
    """One sequence's caches of one layer as whole tensors, as a one-sequence step (the engine's paged caches
    answer the same calls); ``batched``: its decode rows read through the decode batch's calls."""

    def __init__(self, batched: bool = False) -> None:
        self.kv: torch.Tensor | None = None
        self.projections: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.entries_by_name: dict[str, torch.Tensor] = {}
        self.batched = batched

    def write_kv(self, kv: torch.Tensor) -> None:
        self.kv = kv if self.kv is None else torch.cat([self.kv, kv])

    def read_kv(self, start: int, end: int) -> torch.Tensor:
        return self.kv[start:end]

    def write_projections(self, name: str, kv: torch.Tensor, gate: torch.Tensor) -> None:
        old = self.projections.get(name)
        self.projections[name] = (kv, gate) if old is None else (torch.cat([old[0], kv]), torch.cat([old[1], gate]))

    def read_projections(self, name: str, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv, gate = self.projections[name]
        return kv[start:end], gate[start:end]

    def write_entries(self, name: str, first: int, entries: torch.Tensor) -> None:
        old = self.entries_by_name.get(name)
        assert first == (0 if old is None else len(old))
        self.entries_by_name[name] = entries if old is None else torch.cat([old, entries])

    def read_entries(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return self.entries_by_name[name][ids]

    def sequence(self, i: int) -> "SequenceCache":
        assert i == 0
        return self

    def batchable(self, i: int) -> bool:
        return self.batched

    def decode_batch(self, seqs: list[int]) -> "SequenceCache":
        return self

    def window(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        last = len(self.kv) - 1
        positions = torch.arange(last - size + 1, last + 1)
        return self.kv[positions.clamp(min=0)][None], (positions >= 0)[None]

    def entries(self, name: str, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(counts[0])
        return self.entries_by_name[name][:n][None], torch.ones(1, n, dtype=torch.bool)

    def entries_at(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return self.entries_by_name[name][ids]

    def count(self, name: str, values: torch.Tensor, valid: torch.Tensor) -> None:
        pass


def _geometry(cfg: DeepseekV4Config, layer_type: str):
    from strata.pipeline.models.attention_v4 import V4Geometry
    compress = cfg.compress_rates.get(layer_type, 0)
    sparse = layer_type == "compressed_sparse_attention"
    return V4Geometry(cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.q_lora_rank,
                      cfg.o_groups, cfg.o_lora_rank, cfg.sliding_window, compress,
                      cfg.index_n_heads if sparse else 0, cfg.index_head_dim, cfg.index_topk if sparse else 0,
                      cfg.rms_norm_eps)


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "decode-batch"])
@pytest.mark.parametrize("layer_type", ["sliding_attention", "heavily_compressed_attention",
                                        "compressed_sparse_attention"])
def test_attention_equals_the_reference_chunk_by_chunk(layer_type: str, batched: bool) -> None:
    """Chunks of 3, 7, 1, 13 and then single decoded tokens cross the 8-token window and the 4- and 8-token
    compression windows; the indexer keeps 3 of up to 8 entries, so its choice matters. One-row steps go
    through the sequence's own reads, or through a decode batch's padded ones."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    from strata.kernels.rope import RotaryEmbedding
    from strata.pipeline.models.attention_v4 import V4Attention, V4Span
    cfg = DeepseekV4Config(**{**_config().to_dict(), "layer_types": [layer_type] * 2})
    cfg._attn_implementation = "eager"
    theirs = ref.DeepseekV4Attention(cfg, 0).float()
    _randomize(theirs, 7)
    rope = ref.DeepseekV4RotaryEmbedding(cfg)
    main = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters["main"])
    compress = RotaryEmbedding(cfg.head_dim, cfg.rope_parameters["compress"])
    assert torch.equal(main.inv_freq, rope.main_inv_freq) and torch.equal(compress.inv_freq, rope.compress_inv_freq)
    ours = V4Attention(_geometry(cfg, layer_type), (main.inv_freq, main.attention_scaling),
                       (compress.inv_freq, compress.attention_scaling))
    missing = ours.load_state_dict(theirs.state_dict(), strict=False)
    assert not missing.missing_keys and all("rotary_emb" in k for k in missing.unexpected_keys)
    cache, seq = ref.DynamicCache(config=cfg), SequenceCache(batched)
    h = torch.randn(1, 30, HIDDEN)
    start = 0
    for n in [3, 7, 1, 13, 1, 1, 1, 1, 1, 1]:
        rows = h[:, start : start + n]
        positions = torch.arange(start, start + n).unsqueeze(0)
        mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=rows, attention_mask=None, cache=cache,
                                                 position_ids=positions)
        embeddings = {kind: rope(rows, positions, layer_type=kind) for kind in ("main", "compress")}
        expected, _ = theirs(rows, embeddings, positions, mask, cache)
        # each call of the reference picks top-k over the entries closed so far: the engine's rule for a prompt
        # that ends with this chunk (``Indexer.choose``)
        got = ours(rows[0], [V4Span(start, n, prompt_len=start + n)], seq)
        torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-6, msg=f"rows {start}..{start + n}")
        start += n

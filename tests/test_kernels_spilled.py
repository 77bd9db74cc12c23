"""Attention with the oldest blocks off the device equals attention with everything on it."""

from __future__ import annotations

import pytest
import torch

from strata.kernels import AttentionMetadata, attend_spilled, available_backends, get_attention_backend, write_kv
from helpers import BS, dense_reference as _dense_reference


class _HostBlocks:
    """SpilledKV over plain tensors, counting loads (stands in for the host/disk tiers)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, segment_blocks: int) -> None:
        self.k = k.view(-1, BS, *k.shape[1:])
        self.v = v.view(-1, BS, *v.shape[1:])
        self.num_blocks = self.k.shape[0]
        self.segment_blocks = segment_blocks
        self.loaded_blocks = 0

    def load(self, layer: int, first_block: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert num_blocks <= self.segment_blocks
        self.loaded_blocks += num_blocks
        sl = slice(first_block, first_block + num_blocks)
        return self.k[sl].clone(), self.v[sl].clone()


@pytest.mark.parametrize("backend", available_backends("cpu"))
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 8), (8, 2, 16)])
def test_spilled_segments_merge_to_the_dense_result(hq: int, hkv: int, d: int, window: int | None, backend: str) -> None:
    """The device part's log-sum-exp comes from the backend under test (the fast one included)."""
    gen = torch.Generator().manual_seed(hq + hkv + (window or 0))
    seq_lens = [100, 70, 33, 120]
    # a decode, a chunk after a spilled prefix, a seq with nothing spilled, a long chunk after a spilled prefix
    query_lens = [1, 12, 33, 40]
    spilled_blocks = [5, 3, 0, 2]
    k_cache = torch.zeros(30, BS, hkv, d)
    v_cache = torch.zeros(30, BS, hkv, d)
    free = list(range(30))
    tables, slots, dense, sources = [], [], [], []
    for s_len, q_len, nsp in zip(seq_lens, query_lens, spilled_blocks):
        k = torch.randn(s_len, hkv, d, generator=gen)
        v = torch.randn(s_len, hkv, d, generator=gen)
        dense.append((k, v))
        off = nsp * BS
        sources.append(_HostBlocks(k[:off], v[:off], segment_blocks=2) if nsp else None)
        blocks = [free.pop() for _ in range(-(-(s_len - off) // BS))]
        all_slots = torch.tensor([blocks[(p - off) // BS] * BS + (p - off) % BS for p in range(off, s_len)])
        write_kv(k_cache, v_cache, k[off:], v[off:], all_slots)
        tables.append(blocks)
        slots.extend(all_slots[len(all_slots) - q_len :].tolist())
    meta = AttentionMetadata.build(
        query_lens, seq_lens, tables, slots, BS, kv_offsets=[n * BS for n in spilled_blocks], spilled=sources
    )
    q = torch.randn(sum(query_lens), hq, d, generator=gen)
    scale = d**-0.5
    out, lse = get_attention_backend(backend).forward(q, k_cache, v_cache, meta, scale, window, return_lse=True)
    out = attend_spilled(q, out, lse, meta, 0, scale, window)
    start = 0
    for (k, v), s_len, q_len in zip(dense, seq_lens, query_lens):
        ref = _dense_reference(q[start : start + q_len], k, v, torch.arange(s_len - q_len, s_len), window)
        torch.testing.assert_close(out[start : start + q_len], ref, rtol=1e-5, atol=1e-5)
        start += q_len
    decode_source = sources[0]
    assert decode_source is not None
    if window is None:
        assert decode_source.loaded_blocks == 5  # every spilled block, in segments of 2
    else:
        assert decode_source.loaded_blocks < 5  # blocks wholly outside the window are never loaded


def test_metadata_without_spill_keeps_the_fast_path() -> None:
    meta = AttentionMetadata.build([1], [5], [[0]], [4], BS, kv_offsets=[0], spilled=[None])
    assert meta.spilled is None and meta.kv_offsets == []


@pytest.mark.parametrize("window", [None, 100])
def test_long_key_ranges_are_attended_in_bounded_segments(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """The LSE path splits keys so scores stay bounded; the merged result equals one big softmax."""
    import strata.kernels.attention_torch as attention_torch

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 300, 4, 8, generator=gen)
    k, v = torch.randn(1, 1000, 2, 8, generator=gen), torch.randn(1, 1000, 2, 8, generator=gen)
    q_pos, k_pos = torch.arange(700, 1000)[None], torch.arange(1000)[None]
    valid = torch.ones(1, 1000, dtype=torch.bool)
    whole = attention_torch.attend_with_positions(q, k, v, q_pos, k_pos, valid, 8**-0.5, window, True)
    monkeypatch.setattr(attention_torch, "_SCORE_ELEMS", 300 * 4 * 64)  # 64 keys per segment
    split = attention_torch.attend_with_positions(q, k, v, q_pos, k_pos, valid, 8**-0.5, window, True)
    torch.testing.assert_close(split[0], whole[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split[1], whole[1], rtol=1e-5, atol=1e-5)
    ref = _dense_reference(q[0], k[0], v[0], q_pos[0], window)
    torch.testing.assert_close(split[0][0], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_fused_lse_path_equals_the_explicit_softmax(monkeypatch: pytest.MonkeyPatch, hq: int, hkv: int, window) -> None:
    """The fused kernel (with LSE) and the explicit scores path agree, including rows that see no key."""
    import strata.kernels.attention_torch as attention_torch

    gen = torch.Generator().manual_seed(hq + hkv)
    q = torch.randn(2, 20, hq, 8, generator=gen)
    k, v = torch.randn(2, 50, hkv, 8, generator=gen), torch.randn(2, 50, hkv, 8, generator=gen)
    q_pos = torch.arange(30, 50).expand(2, -1)
    k_pos = torch.arange(0, 50).expand(2, -1) + torch.tensor([[0], [31]])  # 2nd row: the first query sees no key
    valid = torch.ones(2, 50, dtype=torch.bool)
    valid[1, 40:] = False
    args = (q, k, v, q_pos, k_pos, valid, 0.35, window, True)
    fused = attention_torch.attend_with_positions(*args)
    monkeypatch.setattr(attention_torch, "USE_FUSED_LSE", False)
    explicit = attention_torch.attend_with_positions(*args)
    assert torch.isinf(explicit[1]).any(), "the case must include a row with no visible key"
    torch.testing.assert_close(fused[0], explicit[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1], explicit[1], rtol=1e-5, atol=1e-5)

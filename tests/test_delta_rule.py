"""The linear-attention kernels of Gated DeltaNet (Qwen3-Next, Qwen3.5) and KDA (Kimi-Linear) and the state pool
they run over: the chunked delta rule against transformers' reference functions and across any cut, the C++
decode step against the torch step over pool slots, the causal convolution's state, and the pool's slots.
The engine through chunks, preemption, spills, prefix hits and hand-offs is in test_linear_attention.py."""

from __future__ import annotations

import pytest
import torch

from strata.kernels.delta_rule import (causal_conv, causal_conv_step, delta_rule_chunked, delta_rule_step,
                                       l2_normalize, l2_normalize_div)
from strata.kvstore.state_pool import StateKind, StatePool


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

"""gpt-oss's attention sinks and RMSNorm order against transformers' own gpt-oss functions.

Sinks are applied to any backend's output through its log-sum-exp (``kernels.sinks``), so each CPU
backend is checked with sinks against transformers' eager gpt-oss attention, windows included; the
Triton and vendor backends' log-sum-exp is held to the torch backend's by their own tests.
"""

from __future__ import annotations

import pytest
import torch

from strata.kernels import available_backends, get_attention_backend, rms_norm
from strata.kernels.sinks import apply_sinks

from helpers import paged_batch


def _gpt_oss_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int | None,
                       sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """transformers' ``eager_attention_forward`` of gpt-oss over one sequence (q [Tq,Hq,D], k/v [S,Hkv,D])."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    hq, hkv = q.shape[1], k.shape[1]
    k_pos = torch.arange(k.shape[0])
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=hq // hkv, sinks=sinks, training=False)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scale)
    return out[0]


@pytest.mark.parametrize("backend", available_backends("cpu"))
@pytest.mark.parametrize("window", [None, 5, 20])
def test_sinks_on_every_backend_equal_gpt_oss_attention(backend: str, window: int | None) -> None:
    gen = torch.Generator().manual_seed(7 + (window or 0))
    hq, hkv, d = 8, 2, 16
    seq_lens, query_lens = [1, 17, 40, 33, 70], [1, 17, 1, 9, 45]  # a decode, a prompt, chunks after context
    k_cache, v_cache, dense, meta = paged_batch(seq_lens, query_lens, hkv, d, 40, gen)
    q = torch.randn(sum(query_lens), hq, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) * 2  # some heads put most of their weight on the sink
    out, lse = get_attention_backend(backend).forward(q, k_cache, v_cache, meta, d**-0.5, window, return_lse=True)
    with_sinks = apply_sinks(out, lse, sinks)
    start = 0
    for (k, v), n, ql in zip(dense, seq_lens, query_lens):
        ref = _gpt_oss_reference(q[start:start + ql], k, v, torch.arange(n - ql, n), window, sinks, d**-0.5)
        torch.testing.assert_close(with_sinks[start:start + ql], ref, rtol=1e-5, atol=1e-5)
        start += ql
    assert not torch.allclose(with_sinks, out, atol=1e-3)  # the sinks took weight


def test_a_row_that_sees_no_key_stays_zero_with_a_sink() -> None:
    out = torch.zeros(1, 2, 4)
    lse = torch.full((1, 2), float("-inf"))
    assert torch.equal(apply_sinks(out, lse, torch.tensor([0.5, -3.0])), out)


def test_rms_norm_with_a_widened_weight_is_gpt_oss_order_bit_for_bit() -> None:
    """gpt-oss scales in fp32 and casts once; its weight held widened gives the same bf16 bits (the Llama
    order, cast then scale, does not)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    ref = GptOssRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    ref.weight.data = (torch.rand(64, generator=torch.Generator().manual_seed(0)) + 0.5).to(torch.bfloat16)
    x = (torch.randn(200, 64, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    expected = ref(x)
    assert torch.equal(rms_norm(x, ref.weight.float(), 1e-5), expected)
    assert not torch.equal(rms_norm(x, ref.weight, 1e-5), expected)

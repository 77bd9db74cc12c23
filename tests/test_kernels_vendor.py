"""The vendor backends' glue, checked where it can be without a GPU: the self-check catches a kernel
whose log-sum-exp is in another base, FlashInfer's page table equals the block tables, and vLLM's
FlashAttention is looked for where current vLLM ships it. (The kernels themselves: tests/test_cuda.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from strata.kernels import AttentionMetadata, available_backends, get_attention_backend
from strata.kernels.attention_torch import TorchAttentionBackend
from strata.kernels.attention_vendor import FlashInferBackend, VllmFlashAttnBackend, check_against_reference, \
    flashinfer_pages


class _Log2Lse(TorchAttentionBackend):
    """The reference, reporting its LSE in base 2 as FlashInfer does."""

    name = "log2-lse"

    def forward(self, *args, **kwargs):
        out, lse = super().forward(*args, **kwargs)
        return out, (None if lse is None else lse / math.log(2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_self_check_passes_every_cpu_backend_and_catches_a_base_2_lse(dtype: torch.dtype) -> None:
    for name in available_backends("cpu", dtype):
        check_against_reference(get_attention_backend(name, "cpu", dtype), torch.device("cpu"), dtype)
    with pytest.raises(AssertionError, match="log-sum-exp differs"):
        check_against_reference(_Log2Lse(), torch.device("cpu"), dtype)


def test_flashinfer_page_table_lists_each_sequences_pages() -> None:
    bs = 16
    seq_lens, query_lens, offsets = [1, 40, 70, 33], [1, 40, 1, 20], [0, 0, 32, 16]
    tables = [[5], [1, 2, 3], [7, 8, 9], [4, 6]]
    slots = [0] * sum(query_lens)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, bs, "cpu", kv_offsets=offsets)
    qo, kv, indices, last = flashinfer_pages(meta)
    assert qo.tolist() == [0, 1, 41, 42, 62]
    assert kv.tolist() == [0, 1, 4, 7, 9] and indices.tolist() == [5, 1, 2, 3, 7, 8, 9, 4, 6]
    assert last.tolist() == [1, 8, 6, 1]  # keys in each last page: 1, 40-32, 38-32, 17-16
    assert indices.dtype == qo.dtype == torch.int32


def test_vendor_kernels_are_looked_for_where_they_ship() -> None:
    assert VllmFlashAttnBackend.modules[0] == "vllm.vllm_flash_attn"  # inside vLLM since 2024
    assert FlashInferBackend.modules == ("flashinfer",)
    for cls in (VllmFlashAttnBackend, FlashInferBackend):
        assert not cls.is_available(torch.device("cpu"), torch.bfloat16)

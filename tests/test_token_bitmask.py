"""The grammar mask on logits (``kernels.token_bitmask``): the C++ kernel equals the torch reference bit for
bit, in every dtype, on masks of all-allowed, all-blocked and mixed words, a vocabulary that is not a
multiple of 32 and logits wider than the mask; rows not named are untouched."""

from __future__ import annotations

import pytest
import torch

from strata.kernels.cpu_kernels import cpu_kernels
from strata.kernels.token_bitmask import allowed_tokens, apply_token_bitmask, apply_token_bitmask_torch


def _mask(rows: int, words: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[:, ::3] = -1  # whole words allowed
    bits[:, 1::5] = 0  # whole words blocked
    return bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab, words", [(49152, 1536), (1000, 32), (1000, 30)], ids=["exact", "ragged", "wider"])
def test_the_kernel_equals_the_reference(dtype: torch.dtype, vocab: int, words: int) -> None:
    if cpu_kernels() is None:
        pytest.skip("the C++ kernels cannot be built here")
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    bitmask, rows = _mask(3, words, 2), torch.tensor([4, 0, 2])
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask, rows)
    apply_token_bitmask_torch(ref, bitmask, rows)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 3, 5]], logits[[1, 3, 5]])  # rows not named: untouched
    allowed = allowed_tokens(bitmask, vocab)
    assert torch.equal(torch.isfinite(ours[rows]), allowed)  # exactly the allowed tokens survive
    if vocab > words * 32:
        assert not allowed[:, words * 32:].any()

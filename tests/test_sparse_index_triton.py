"""DSA's indexer scores in Triton against the torch reference, on CPU in Triton's interpreter
(``TRITON_INTERPRET=1`` must be set before Triton is imported, so the check runs in a child process): head widths
that are not powers of two, token counts that end mid-block, scores that are exactly 0 where every head's ReLU
closes (the ties the top-k rule decides). On a CUDA machine the same cases run compiled."""

from __future__ import annotations

import pytest
import torch
from helpers import kernel_check

pytestmark = pytest.mark.slow

_CHECK = r"""
import json, sys
import torch
from strata.kernels.sparse_index import index_scores_reference as index_scores
from strata.kernels.sparse_index_triton import triton_index_scores
device = sys.argv[1]
g = torch.Generator().manual_seed(0)
results = []
for rows, heads, dim, tokens in ((1, 2, 16, 100), (5, 4, 24, 64), (3, 64, 128, 130)):
    q, keys = torch.randn(rows, heads, dim, generator=g), torch.randn(tokens, dim, generator=g)
    weights = torch.randn(rows, heads, generator=g)
    want = index_scores(q, keys, weights, dim ** -0.5)
    got = triton_index_scores(q.to(device), keys.to(device), weights.to(device), dim ** -0.5).cpu()
    results.append({"shape": [rows, heads, dim, tokens], "err": (got - want).abs().max().item(),
                    "zeros": int((want == 0).sum()), "zeros_kept": bool(torch.equal(got == 0, want == 0))})
print(json.dumps(results))
"""


def _check(results: list[dict]) -> None:
    assert len(results) == 3 and results[0]["zeros"] > 0  # two heads: a quarter of the scores are exactly 0
    for r in results:
        assert r["err"] <= 1e-4 and r["zeros_kept"], r


def test_the_triton_index_scores_equal_the_torch_reference_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    _check(kernel_check(_CHECK, "cpu", interpret=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_triton_index_scores_equal_the_torch_reference_on_cuda() -> None:
    _check(kernel_check(_CHECK, "cuda", interpret=False))

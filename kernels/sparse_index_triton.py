"""DSA's indexer scores on CUDA in one Triton launch (``kernels.sparse_index.index_scores``'s arithmetic): a
program per query row and block of tokens sums the ReLU'd, weighted head dot products in registers, so the
[rows, heads, tokens] intermediate the torch reference builds never reaches memory. Tested against the torch
reference on CPU under ``TRITON_INTERPRET=1`` (set before Triton is imported). The top-k stays
``torch.topk`` (``kernels.sparse_index.select_topk``): its tie rule is transformers'.
"""

from __future__ import annotations

import torch

from strata.kernels.triton_import import triton_kernel

BLOCK_T = 64


def triton_index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """I [rows, tokens] fp32 from ``q`` [rows, heads, dim], ``keys`` [tokens, dim], ``weights`` [rows, heads]."""
    triton, kernel = triton_kernel("sparse_index_triton_kernel", "index_scores_kernel")
    q, keys, weights = (t.float().contiguous() for t in (q, keys, weights))
    rows, heads, dim = q.shape
    tokens = keys.shape[0]
    out = torch.empty(rows, tokens, dtype=torch.float32, device=q.device)
    if rows and tokens:
        kernel[(rows, triton.cdiv(tokens, BLOCK_T))](q, keys, weights, out, tokens, heads, dim, scale,
                                                    BLOCK_T=BLOCK_T, BLOCK_D=triton.next_power_of_2(dim))
    return out

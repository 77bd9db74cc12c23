"""The Triton kernel behind :mod:`kernels.sparse_index_triton` (imported only where Triton is installed)."""

import triton
import triton.language as tl


@triton.jit
def index_scores_kernel(q_ptr, k_ptr, w_ptr, out_ptr, T, H, D, scale, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program: one query row and ``BLOCK_T`` tokens. Head by head, the tokens' dot products with the
    row's head query, ReLU'd and weighted, summed into the row's scores: no [heads, tokens] intermediate."""
    row = tl.program_id(0)
    rt = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    rd = tl.arange(0, BLOCK_D)
    mt = rt < T
    md = rd < D
    keys = tl.load(k_ptr + rt[:, None] * D + rd[None, :], mask=mt[:, None] & md[None, :], other=0.0)
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for h in range(H):
        q = tl.load(q_ptr + (row * H + h) * D + rd, mask=md, other=0.0)
        dots = tl.sum(keys * q[None, :], axis=1) * scale
        acc += tl.load(w_ptr + row * H + h) * tl.maximum(dots, 0.0)
    tl.store(out_ptr + row * T + rt, acc, mask=mt)

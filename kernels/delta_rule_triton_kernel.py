"""The Triton kernel behind :mod:`kernels.delta_rule_triton` (imported only where Triton is installed)."""

import triton
import triton.language as tl


@triton.jit
def delta_rule_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pool_ptr, read_ptr, write_ptr, out_ptr, H, K, V,
                           slot_stride, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """One program: one (sequence, value head) and ``BLOCK_V`` columns of its [K, V] state. A column's update
    needs only that column (delta_j = beta (v_j - (D S)[:, j] . k)), so columns split across programs. The
    decay D is exp(g) for every row, or exp(g_i) for row i with ``PER_CHANNEL`` (KDA)."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    rk = tl.arange(0, BLOCK_K)
    rv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = rk < K
    mv = rv < V
    tile = rk[:, None] * V + rv[None, :]
    mask = mk[:, None] & mv[None, :]
    src = pool_ptr + tl.load(read_ptr + b) * slot_stride + h * K * V
    dst = pool_ptr + tl.load(write_ptr + b) * slot_stride + h * K * V
    s = tl.load(src + tile, mask=mask, other=0.0)
    k = tl.load(k_ptr + bh * K + rk, mask=mk, other=0.0)
    q = tl.load(q_ptr + bh * K + rk, mask=mk, other=0.0)
    if PER_CHANNEL:
        s = s * tl.exp(tl.load(g_ptr + bh * K + rk, mask=mk, other=0.0))[:, None]
    else:
        s = s * tl.exp(tl.load(g_ptr + bh))
    beta = tl.load(beta_ptr + bh)
    v = tl.load(v_ptr + bh * V + rv, mask=mv, other=0.0)
    delta = beta * (v - tl.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * delta[None, :]
    tl.store(dst + tile, s, mask=mask)
    tl.store(out_ptr + bh * V + rv, tl.sum(s * q[:, None], axis=0), mask=mv)

"""The Triton kernel behind :mod:`kernels.attention_triton` (imported only where Triton is installed)."""

import triton
import triton.language as tl

from strata.kernels.quant_linear_triton_kernel import e4m3


@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    tile_seq_ptr, tile_row_ptr, q_start_ptr, seq_len_ptr, kv_off_ptr, table_ptr,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_table, scale, window,
    GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, WANT_LSE: tl.constexpr, EXACT: tl.constexpr,
    UPCAST_DOTS: tl.constexpr, FP8_KV: tl.constexpr,
):
    # Rows of this program: BLOCK_M query positions x HEADS query heads that share one KV head,
    # so each key/value block is read once for all of them.
    tile = tl.program_id(0)
    first_head = tl.program_id(1) * HEADS
    kv_head = first_head // GROUP
    seq = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_len_ptr + seq)
    kv_off = tl.load(kv_off_ptr + seq)
    r = tl.arange(0, BLOCK_M * HEADS)
    rows = row0 + r // HEADS
    heads = first_head + r % HEADS
    row_ok = rows < q_len
    pos = seq_len - q_len + rows  # absolute position of each query row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([BLOCK_M * HEADS], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * HEADS], tl.float32)
    acc = tl.zeros([BLOCK_M * HEADS, BLOCK_D], tl.float32)
    last_pos = seq_len - q_len + tl.minimum(row0 + BLOCK_M, q_len) - 1
    first_key = kv_off
    if window > 0:
        first_key = tl.maximum(kv_off, seq_len - q_len + row0 - window + 1)
    start_block = (first_key - kv_off) // BLOCK_SIZE
    end_block = (last_pos - kv_off) // BLOCK_SIZE + 1
    t = tl.arange(0, BLOCK_SIZE)
    for b in range(start_block, end_block):
        block = tl.load(table_ptr + seq * stride_table + b).to(tl.int64)
        key_pos = kv_off + b * BLOCK_SIZE + t
        kv_ok = (key_pos < seq_len)[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block * stride_kb + t[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=kv_ok, other=0)
        v = tl.load(v_ptr + block * stride_vb + t[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=kv_ok, other=0)
        if FP8_KV:  # e4m3 bytes widened to the query's dtype (the scales are folded into q and the output)
            k = e4m3(k).to(q.dtype)
            v = e4m3(v).to(q.dtype)
        # fp32 caches: exact fp32 dots; bf16/fp16: tensor-core dots accumulating in fp32
        if EXACT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        elif UPCAST_DOTS:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] < seq_len) & row_ok[:, None]
        if window > 0:
            visible = visible & (key_pos[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        new_m = tl.maximum(m, tl.max(s, 1))
        safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
        p = tl.exp(s - safe_m[:, None])
        correction = tl.exp(m - safe_m)
        l = l * correction + tl.sum(p, 1)
        if EXACT:
            acc = acc * correction[:, None] + tl.dot(p, v, input_precision="ieee")
        elif UPCAST_DOTS:
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
        m = new_m
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if WANT_LSE:
        lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + (q_start + rows) * stride_lt + heads, lse, mask=row_ok)

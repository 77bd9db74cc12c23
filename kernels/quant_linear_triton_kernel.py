"""The Triton kernel behind :mod:`kernels.quant_linear_triton` (imported only where Triton is installed):
a tile of ``y = x @ W^T + b`` with W's codes widened to fp32 in registers, per weight format."""

import triton
import triton.language as tl


@triton.jit
def pow2(e):
    """2^e for integer e in [-126, 127], exactly, from its bits."""
    return ((e + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3(b):
    """uint8 e4m3 codes -> fp32 (normal: (8 + m) 2^(e - 10); subnormal: m 2^-9)."""
    u = b.to(tl.int32)
    e = (u >> 3) & 0xF
    m = (u & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (m + 8.0) * pow2(e - 10))
    return tl.where((u & 0x80) != 0, -mag, mag)


@triton.jit
def fp16_at(ptr, mask):
    """The little-endian fp16 at two bytes ``ptr`` as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def widen(w_ptr, s_ptr, z_ptr, rb_ptr, n, k, mask, stride_w, stride_s, stride_z, block_rows, block_cols, group,
          FORMAT: tl.constexpr, KIND: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_RB: tl.constexpr):
    """W[n, k] in fp32 for a tile of rows ``n`` [BN, 1] and columns ``k`` [1, BK]."""
    if FORMAT == 0:  # FP8 blocks: code * scale[row's scale row, k // block_cols]
        code = e4m3(tl.load(w_ptr + n * stride_w + k, mask=mask, other=0))
        if HAS_RB:
            srow = tl.load(rb_ptr + n, mask=mask, other=0)
        else:
            srow = n // block_rows
        return code * tl.load(s_ptr + srow * stride_s + k // block_cols, mask=mask, other=0.0)
    elif FORMAT == 1:  # FP8 rows: code * scale[row]
        code = e4m3(tl.load(w_ptr + n * stride_w + k, mask=mask, other=0))
        return code * tl.load(s_ptr + n, mask=mask, other=0.0)
    elif FORMAT == 2:  # INT4 groups: (nibble - 8 - zero) * scale, eight nibbles a word
        word = tl.load(w_ptr + n * stride_w + k // 8, mask=mask, other=0)
        q = ((word >> ((k % 8) * 4)) & 0xF) - 8
        if HAS_ZERO:
            q = q - tl.load(z_ptr + n * stride_z + k // group, mask=mask, other=0).to(tl.int32)
        return q.to(tl.float32) * tl.load(s_ptr + n * stride_s + k // group, mask=mask, other=0.0).to(tl.float32)
    elif FORMAT == 3:  # MXFP4: e2m1 (low nibble first) * 2^(E8M0 - 127)
        byte = tl.load(w_ptr + n * stride_w + k // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((k % 2) * 4)) & 0xF
        mag_code = code & 7
        mag = tl.where(mag_code < 2, mag_code.to(tl.float32) * 0.5,
                       (2 + (mag_code & 1)).to(tl.float32) * pow2((mag_code >> 1) - 2))
        e = tl.load(s_ptr + n * stride_s + k // 32, mask=mask, other=127).to(tl.int32)
        scale = tl.where(e == 0, 5.877471754111438e-39, pow2(tl.maximum(e, 1) - 127))  # 2^-127 is subnormal
        return tl.where((code & 8) != 0, -mag, mag) * scale
    else:  # GGUF blocks of 32: [fp16 d][fp16 m: q4_1][codes]; KIND 0 q4_0, 1 q4_1, 2 q8_0
        block_bytes: tl.constexpr = 18 if KIND == 0 else (20 if KIND == 1 else 34)
        base = w_ptr + n * stride_w + (k // 32) * block_bytes
        j = k % 32
        d = fp16_at(base, mask)
        if KIND == 2:
            q = tl.load(base + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            return d * q
        else:
            byte = tl.load(base + (4 if KIND == 1 else 2) + j % 16, mask=mask, other=0).to(tl.int32)
            q = tl.where(j < 16, byte & 0xF, byte >> 4).to(tl.float32)
            if KIND == 0:
                return d * (q - 8.0)
            else:
                return d * q + fp16_at(base + 2, mask)


@triton.jit
def quant_matmul_kernel(x_ptr, w_ptr, s_ptr, z_ptr, rb_ptr, b_ptr, y_ptr, M, N, K,
                        stride_xm, stride_w, stride_s, stride_z, stride_ym, block_rows, block_cols, group,
                        FORMAT: tl.constexpr, KIND: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_RB: tl.constexpr,
                        HAS_BIAS: tl.constexpr, EXACT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        w_mask = (rn[:, None] < N) & (rk[None, :] < K)
        w = widen(w_ptr, s_ptr, z_ptr, rb_ptr, rn[:, None], rk[None, :], w_mask, stride_w, stride_s, stride_z,
                  block_rows, block_cols, group, FORMAT, KIND, HAS_ZERO, HAS_RB)
        w = tl.where(w_mask, w, 0.0)
        if EXACT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w).to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)

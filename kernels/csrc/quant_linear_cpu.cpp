// y = x W^T + b for a handful of rows of x with W kept quantized: the weight-streaming GEMV of
// small_linear_cpu.cpp, reading FP8 (one byte a weight), INT4 or MXFP4 (half a byte) instead of fp32.
//
// Decode is bound by reading the weights, so the fewer bytes a weight takes, the faster a step; the codes
// are widened to fp32 in registers, eight at a time, and scaled there: nothing dequantized reaches memory.
// The number of rows of x is a template parameter, so each row's two accumulators stay in registers.
//
// Widening: FP8 e4m3 (no infinities): for a byte b, the fp32 whose bits are (b & 0x7f) << 20 is b's
// magnitude times 2^-120 (normal and subnormal codes alike: both formats put the mantissa right below the
// exponent); the sign bit moves to bit 31, and 2^120 is folded into the block's scale. INT4: eight nibbles
// a word, element i at bits 4i, stored as q + 8: w = (nibble - 8 - zero) * scale. MXFP4: two e2m1 nibbles
// a byte (element 2i low; four bytes are eight nibbles in element order, read as one word), the
// magnitude looked up in an 8-entry table already times the group's power-of-two scale, the sign xored in.
// Byte and nibble widening use AVX2 where the compiler targets it (GCC turns generic integer-widening
// vector conversions into scalar code); elsewhere a portable path computes the same values.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

constexpr int kMaxRows = 8;
constexpr float kTwoPow120 = 1.329227995784916e36f;  // 2^120
constexpr v8 kE2M1 = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline v8 splat(float s) { return v8{s, s, s, s, s, s, s, s}; }

inline float hsum(v8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// eight bytes -> eight uint32
inline u32x8 widen_bytes(const uint8_t* p) {
#if defined(__AVX2__)
  __m128i b;
  std::memcpy(&b, p, 8);
  return reinterpret_cast<u32x8>(_mm256_cvtepu8_epi32(b));
#else
  return u32x8{p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
#endif
}

// the eight nibbles of a word, element i = bits 4i .. 4i+3
inline u32x8 nibbles(uint32_t word) {
  const u32x8 shifts = {0, 4, 8, 12, 16, 20, 24, 28};
  const u32x8 w = {word, word, word, word, word, word, word, word};
  return (w >> shifts) & 0xFu;
}

// eight e4m3 codes, times 2^-120 (the caller's scale holds 2^120)
inline v8 fp8x8(const uint8_t* p) {
  const u32x8 b = widen_bytes(p);
  const u32x8 bits = ((b << 24) & 0x80000000u) | ((b << 20) & 0x07F00000u);
  return reinterpret_cast<v8>(bits);
}

// A block's scale with 2^120 folded in (one multiply a code), unless that would overflow (a scale of 2^8 or
// more): then two. Either way the product is the exact code times the scale, rounded once.
struct Fp8Scale {
  explicit Fp8Scale(float scale)
      : folded(scale * kTwoPow120), plain(scale), fold(std::isfinite(scale * kTwoPow120)) {}
  v8 apply(v8 codes) const { return fold ? codes * splat(folded) : (codes * splat(kTwoPow120)) * splat(plain); }
  float apply(float code) const { return fold ? code * folded : (code * kTwoPow120) * plain; }
  float folded, plain;
  bool fold;
};

inline float fp8_one(uint8_t b) {
  const uint32_t bits = ((static_cast<uint32_t>(b) & 0x7fu) << 20) | ((static_cast<uint32_t>(b) & 0x80u) << 24);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// 2^(e - 127), the E8M0 scale (e = 0 is the subnormal 2^-127; 255, NaN in the spec, reads as 2^128 = inf)
inline float e8m0(uint8_t e) {
  const uint32_t bits = e == 0 ? 0x00400000u : static_cast<uint32_t>(e) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// the e2m1 value of each nibble, from ``table`` (the eight magnitudes, already scaled)
inline v8 e2m1x8(u32x8 nib, v8 table) {
#if defined(__AVX2__)
  const __m256 mag = _mm256_permutevar8x32_ps(reinterpret_cast<__m256>(table), reinterpret_cast<__m256i>(nib & 7u));
  const u32x8 sign = (nib & 8u) << 28;
  return reinterpret_cast<v8>(reinterpret_cast<u32x8>(mag) ^ sign);
#else
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = (nib[i] & 8u) ? -table[nib[i] & 7u] : table[nib[i] & 7u];
  return out;
#endif
}

// acc[r] += w * x[r, i .. i+8) for every row r of x
template <int M>
inline void fma_rows(v8 w, const float* x, int64_t k, int64_t i, v8 (&acc)[M]) {
  for (int r = 0; r < M; ++r) acc[r] += w * load8(x + r * k + i);
}

template <int M>
inline void finish(const v8 (&a)[M], const v8 (&b)[M], const float (&tail)[M], float* out) {
  for (int r = 0; r < M; ++r) out[r] = hsum(a[r] + b[r]) + tail[r];
}

// One output row of FP8 blocks: each block's codes widened and scaled by the block's scale.
template <int M>
void fp8_row(const float* x, int64_t k, const uint8_t* w, const float* scale_row, int64_t bn, float* out) {
  v8 a[M] = {}, b[M] = {};
  float tail[M] = {};
  for (int64_t c0 = 0, j = 0; c0 < k; c0 += bn, ++j) {
    const int64_t c1 = std::min(k, c0 + bn);
    const Fp8Scale s(scale_row[j]);
    int64_t i = c0;
    for (; i + 16 <= c1; i += 16) {
      fma_rows<M>(s.apply(fp8x8(w + i)), x, k, i, a);
      fma_rows<M>(s.apply(fp8x8(w + i + 8)), x, k, i + 8, b);
    }
    for (; i + 8 <= c1; i += 8) fma_rows<M>(s.apply(fp8x8(w + i)), x, k, i, a);
    for (; i < c1; ++i) {
      const float wv = s.apply(fp8_one(w[i]));
      for (int r = 0; r < M; ++r) tail[r] += wv * x[r * k + i];
    }
  }
  finish<M>(a, b, tail, out);
}

inline float scale_at(bool bf16, const void* base, int64_t i) {
  return bf16 ? static_cast<float>(static_cast<const at::BFloat16*>(base)[i]) : static_cast<const float*>(base)[i];
}

// One output row of INT4 groups (a multiple of 8 wide): a word of eight codes per step.
template <int M>
void int4_row(const float* x, int64_t k, const int32_t* words, const void* scales, bool bf16, int64_t srow,
              const int8_t* zero, int64_t group, float* out) {
  v8 a[M] = {}, b[M] = {};
  float tail[M] = {};
  const int64_t groups = (k + group - 1) / group;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * group, c1 = std::min(k, c0 + group);
    const float s1 = scale_at(bf16, scales, srow + g);
    const float off1 = 8.f + (zero != nullptr ? static_cast<float>(zero[srow + g]) : 0.f);
    const v8 s = splat(s1), off = splat(off1);
    int64_t i = c0;
    for (; i + 16 <= c1; i += 16) {
      const v8 q0 = __builtin_convertvector(reinterpret_cast<i32x8>(nibbles(words[i / 8])), v8);
      const v8 q1 = __builtin_convertvector(reinterpret_cast<i32x8>(nibbles(words[i / 8 + 1])), v8);
      fma_rows<M>((q0 - off) * s, x, k, i, a);
      fma_rows<M>((q1 - off) * s, x, k, i + 8, b);
    }
    for (; i + 8 <= c1; i += 8) {
      const v8 q = __builtin_convertvector(reinterpret_cast<i32x8>(nibbles(words[i / 8])), v8);
      fma_rows<M>((q - off) * s, x, k, i, a);
    }
    for (; i < c1; ++i) {
      const float q = static_cast<float>((static_cast<uint32_t>(words[i / 8]) >> (4 * (i % 8))) & 0xF);
      for (int r = 0; r < M; ++r) tail[r] += (q - off1) * s1 * x[r * k + i];
    }
  }
  finish<M>(a, b, tail, out);
}

// One output row of MXFP4: a group is 32 inputs in 16 bytes, read as four words of eight nibbles.
template <int M>
void mxfp4_row(const float* x, int64_t k, const uint8_t* w, const uint8_t* scales, float* out) {
  v8 a[M] = {}, b[M] = {};
  const float tail[M] = {};
  for (int64_t g = 0; g < k / 32; ++g) {
    const v8 table = kE2M1 * splat(e8m0(scales[g]));
    uint32_t words[4];
    std::memcpy(words, w + g * 16, 16);
    const int64_t i = g * 32;
    fma_rows<M>(e2m1x8(nibbles(words[0]), table), x, k, i, a);
    fma_rows<M>(e2m1x8(nibbles(words[1]), table), x, k, i + 8, b);
    fma_rows<M>(e2m1x8(nibbles(words[2]), table), x, k, i + 16, a);
    fma_rows<M>(e2m1x8(nibbles(words[3]), table), x, k, i + 24, b);
  }
  finish<M>(a, b, tail, out);
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "the streaming kernels take 1 to 8 rows");
}

const float* bias_of(const at::Tensor& bias, int64_t n) {
  if (bias.numel() == 0) return nullptr;
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n, "bias must be fp32 [N]");
  return bias.data_ptr<float>();
}

// y[:, n0 .. n1) from ``row(m-template, row index, out)``, each thread streaming its own range of W's rows.
template <template <int> class Rows, typename... Args>
at::Tensor stream_rows(const at::Tensor& x, int64_t n, const float* bias, Args... args) {
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(16, n / (4 * std::max(1, at::get_num_threads())));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    float out[kMaxRows];
    for (int64_t row = n0; row < n1; ++row) {
      switch (m) {
        case 1: Rows<1>::run(row, out, args...); break;
        case 2: Rows<2>::run(row, out, args...); break;
        case 3: Rows<3>::run(row, out, args...); break;
        case 4: Rows<4>::run(row, out, args...); break;
        case 5: Rows<5>::run(row, out, args...); break;
        case 6: Rows<6>::run(row, out, args...); break;
        case 7: Rows<7>::run(row, out, args...); break;
        default: Rows<8>::run(row, out, args...); break;
      }
      for (int64_t r = 0; r < m; ++r) yp[r * n + row] = out[r] + (bias != nullptr ? bias[row] : 0.f);
    }
  });
  return y;
}

template <int M>
struct FP8Rows {
  static void run(int64_t row, float* out, const float* x, int64_t k, const uint8_t* w, const float* scale, int64_t c,
                  const int64_t* row_block, int64_t block_rows, int64_t block_cols) {
    const int64_t srow = row_block != nullptr ? row_block[row] : row / block_rows;
    fp8_row<M>(x, k, w + row * k, scale + srow * c, block_cols, out);
  }
};

template <int M>
struct Int4Rows {
  static void run(int64_t row, float* out, const float* x, int64_t k, const int32_t* w, int64_t words,
                  const void* scale, bool bf16, int64_t groups, const int8_t* zero, int64_t group) {
    int4_row<M>(x, k, w + row * words, scale, bf16, row * groups, zero, group, out);
  }
};

template <int M>
struct MXFP4Rows {
  static void run(int64_t row, float* out, const float* x, int64_t k, const uint8_t* w, const uint8_t* scale) {
    mxfp4_row<M>(x, k, w + row * (k / 2), scale + row * (k / 32), out);
  }
};

}  // namespace

// x [M, K] fp32; codes [N, K] float8_e4m3fn; scale [R, C] fp32 with C = ceil(K / block_cols); row_block [N]
// int64 (each row's scale row) or empty (row / block_rows); bias [N] fp32 or empty. Returns y [M, N] fp32.
at::Tensor fp8_block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const at::Tensor& row_block, int64_t block_rows, int64_t block_cols, const at::Tensor& bias) {
  check_x(x);
  const int64_t k = x.size(1), n = codes.size(0);
  TORCH_CHECK(block_rows > 0 && block_cols > 0, "block sizes must be positive");
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.size(1) == k && codes.element_size() == 1,
              "codes must be contiguous one-byte [N, K]");
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.scalar_type() == at::kFloat &&
                  scale.size(1) == (k + block_cols - 1) / block_cols, "scale must be contiguous fp32 [R, ceil(K/bn)]");
  const int64_t* rb = nullptr;
  if (row_block.numel() > 0) {
    TORCH_CHECK(row_block.dim() == 1 && row_block.is_contiguous() && row_block.scalar_type() == at::kLong &&
                    row_block.numel() == n, "row_block must be int64 [N]");
    TORCH_CHECK(row_block.min().item<int64_t>() >= 0 && row_block.max().item<int64_t>() < scale.size(0),
                "row_block names a scale row past the scales");
    rb = row_block.data_ptr<int64_t>();
  } else {
    TORCH_CHECK((n + block_rows - 1) / block_rows <= scale.size(0), "fewer scale rows than blocks of rows");
  }
  return stream_rows<FP8Rows>(x, n, bias_of(bias, n), x.data_ptr<float>(), k,
                              static_cast<const uint8_t*>(codes.data_ptr()), scale.data_ptr<float>(), scale.size(1), rb,
                              block_rows, block_cols);
}

// x [M, K] fp32; packed [N, ceil(K/8)] int32; scale [N, ceil(K/group)] fp32 or bf16; zero [N, groups]
// int8 or empty (symmetric); group a multiple of 8; bias [N] fp32 or empty. Returns y [M, N] fp32.
at::Tensor int4_group_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             const at::Tensor& zero, int64_t group, const at::Tensor& bias) {
  check_x(x);
  const int64_t k = x.size(1), n = packed.size(0);
  TORCH_CHECK(group > 0 && group % 8 == 0, "group must be a multiple of 8");
  const int64_t groups = (k + group - 1) / group;
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kInt &&
                  packed.size(1) == (k + 7) / 8, "packed must be contiguous int32 [N, ceil(K/8)]");
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.size(0) == n && scale.size(1) == groups &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16),
              "scale must be contiguous fp32 or bf16 [N, groups]");
  const int8_t* zp = nullptr;
  if (zero.numel() > 0) {
    TORCH_CHECK(zero.is_contiguous() && zero.scalar_type() == at::kChar && zero.numel() == n * groups,
                "zero must be contiguous int8 [N, groups]");
    zp = zero.data_ptr<int8_t>();
  }
  return stream_rows<Int4Rows>(x, n, bias_of(bias, n), x.data_ptr<float>(), k, packed.data_ptr<int32_t>(),
                               packed.size(1), static_cast<const void*>(scale.data_ptr()),
                               scale.scalar_type() == at::kBFloat16, groups, zp, group);
}

// x [M, K] fp32 (K a multiple of 32); packed [N, K/2] uint8; scale [N, K/32] uint8 (E8M0); bias [N] fp32 or
// empty. Returns y [M, N] fp32.
at::Tensor mxfp4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& bias) {
  check_x(x);
  const int64_t k = x.size(1), n = packed.size(0);
  TORCH_CHECK(k % 32 == 0, "MXFP4 needs a multiple of 32 inputs");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte && packed.size(1) == k / 2,
              "packed must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.scalar_type() == at::kByte && scale.size(0) == n &&
                  scale.size(1) == k / 32, "scale must be contiguous uint8 [N, K/32]");
  return stream_rows<MXFP4Rows>(x, n, bias_of(bias, n), x.data_ptr<float>(), k, packed.data_ptr<uint8_t>(),
                                scale.data_ptr<uint8_t>());
}

// Rows r0 .. r1 of a quantized weight as fp32 [r1 - r0, K]: the tile a GEMM multiplies by when x has more
// rows than the streaming kernels take (prefill, big decode batches). One pass, the codes widened as above.

at::Tensor fp8_block_dequant(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& row_block,
                             int64_t block_rows, int64_t block_cols, int64_t r0, int64_t r1) {
  const int64_t k = codes.size(1);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.element_size() == 1 && 0 <= r0 && r0 <= r1 &&
                  r1 <= codes.size(0), "codes must be contiguous one-byte [N, K] holding rows r0 .. r1");
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.scalar_type() == at::kFloat &&
                  scale.size(1) == (k + block_cols - 1) / block_cols, "scale must be contiguous fp32 [R, ceil(K/bn)]");
  TORCH_CHECK(row_block.numel() == 0 || (row_block.scalar_type() == at::kLong && row_block.is_contiguous() &&
                                         row_block.numel() == codes.size(0)), "row_block must be int64 [N] or empty");
  const int64_t* rb = row_block.numel() > 0 ? row_block.data_ptr<int64_t>() : nullptr;
  if (rb != nullptr) {
    TORCH_CHECK(row_block.min().item<int64_t>() >= 0 && row_block.max().item<int64_t>() < scale.size(0),
                "row_block names a scale row past the scales");
  } else {
    TORCH_CHECK(block_rows > 0 && (r1 + block_rows - 1) / block_rows <= scale.size(0), "fewer scale rows than blocks");
  }
  at::Tensor out = at::empty({r1 - r0, k}, scale.options());
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t c = scale.size(1);
  at::parallel_for(r0, r1, 16, [&](int64_t a, int64_t b) {
    for (int64_t row = a; row < b; ++row) {
      const int64_t srow = rb != nullptr ? rb[row] : row / block_rows;
      const uint8_t* w = cp + row * k;
      float* o = op + (row - r0) * k;
      for (int64_t c0 = 0, j = 0; c0 < k; c0 += block_cols, ++j) {
        const int64_t c1 = std::min(k, c0 + block_cols);
        const Fp8Scale s(sp[srow * c + j]);
        int64_t i = c0;
        for (; i + 8 <= c1; i += 8) *reinterpret_cast<v8u*>(o + i) = s.apply(fp8x8(w + i));
        for (; i < c1; ++i) o[i] = s.apply(fp8_one(w[i]));
      }
    }
  });
  return out;
}

at::Tensor int4_group_dequant(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero, int64_t group,
                              int64_t k, int64_t r0, int64_t r1) {
  TORCH_CHECK(group > 0 && group % 8 == 0, "group must be a multiple of 8");
  const int64_t groups = (k + group - 1) / group;
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kInt &&
                  packed.size(1) == (k + 7) / 8 && 0 <= r0 && r0 <= r1 && r1 <= packed.size(0),
              "packed must be contiguous int32 [N, ceil(K/8)] holding rows r0 .. r1");
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.size(0) == packed.size(0) && scale.size(1) == groups &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16),
              "scale must be contiguous fp32 or bf16 [N, groups]");
  TORCH_CHECK(zero.numel() == 0 || (zero.is_contiguous() && zero.scalar_type() == at::kChar &&
                                    zero.numel() == packed.size(0) * groups), "zero must be contiguous int8 [N, groups]");
  const int8_t* zp = zero.numel() > 0 ? zero.data_ptr<int8_t>() : nullptr;
  const bool bf16 = scale.scalar_type() == at::kBFloat16;
  at::Tensor out = at::empty({r1 - r0, k}, packed.options().dtype(at::kFloat));
  const int32_t* wp = packed.data_ptr<int32_t>();
  const void* sp = scale.data_ptr();
  float* op = out.data_ptr<float>();
  const int64_t words = packed.size(1);
  at::parallel_for(r0, r1, 16, [&](int64_t a, int64_t b) {
    for (int64_t row = a; row < b; ++row) {
      const int32_t* w = wp + row * words;
      float* o = op + (row - r0) * k;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t c0 = g * group, c1 = std::min(k, c0 + group);
        const float s1 = scale_at(bf16, sp, row * groups + g);
        const float off1 = 8.f + (zp != nullptr ? static_cast<float>(zp[row * groups + g]) : 0.f);
        int64_t i = c0;
        for (; i + 8 <= c1; i += 8) {
          const v8 q = __builtin_convertvector(reinterpret_cast<i32x8>(nibbles(w[i / 8])), v8);
          *reinterpret_cast<v8u*>(o + i) = (q - splat(off1)) * splat(s1);
        }
        for (; i < c1; ++i)
          o[i] = (static_cast<float>((static_cast<uint32_t>(w[i / 8]) >> (4 * (i % 8))) & 0xF) - off1) * s1;
      }
    }
  });
  return out;
}

at::Tensor mxfp4_dequant(const at::Tensor& packed, const at::Tensor& scale, int64_t r0, int64_t r1) {
  const int64_t k = packed.size(1) * 2;
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte && k % 32 == 0 &&
                  0 <= r0 && r0 <= r1 && r1 <= packed.size(0), "packed must be contiguous uint8 [N, K/2] holding rows r0 .. r1");
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.scalar_type() == at::kByte &&
                  scale.size(0) == packed.size(0) && scale.size(1) == k / 32, "scale must be contiguous uint8 [N, K/32]");
  at::Tensor out = at::empty({r1 - r0, k}, packed.options().dtype(at::kFloat));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint8_t* sp = scale.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(r0, r1, 16, [&](int64_t a, int64_t b) {
    for (int64_t row = a; row < b; ++row) {
      float* o = op + (row - r0) * k;
      for (int64_t g = 0; g < k / 32; ++g) {
        const v8 table = kE2M1 * splat(e8m0(sp[row * (k / 32) + g]));
        uint32_t words[4];
        std::memcpy(words, wp + row * (k / 2) + g * 16, 16);
        for (int q = 0; q < 4; ++q) *reinterpret_cast<v8u*>(o + g * 32 + q * 8) = e2m1x8(nibbles(words[q]), table);
      }
    }
  });
  return out;
}

// y = x W^T + b for x with more rows than the weight-streaming kernels take (bigger decode batches,
// prefill), W kept quantized: a GEMM whose packing step is the dequantization.
//
// The tile path (dequantize a few MB of W to fp32, then torch's GEMM) writes every weight out to memory
// and reads it back each step, so at 16-64 rows a quantized model ran at 0.6-0.7x of the same model in
// fp32. Here each thread dequantizes kRows rows of W at a time into a buffer that stays in L1/L2 (the
// format's own row function, the same values the tile holds) and multiplies them at once by every row of
// x: x is transposed once per call, so one vector load holds a column of x for kLanes rows, and each
// weight is one broadcast into the accumulators of one or two such vectors, all in registers. A weight is widened once
// per call whatever the number of rows, and nothing dequantized leaves the cache.
//
// Every output is one fused multiply-add chain over K in index order, so a row's result does not depend on
// the other rows in the call (batch invariance) or on how the threads split W.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

// Native vector width (a wider GCC vector than the machine has is split and kept in memory), and the
// rows of W dequantized at a time: kRows x 1 accumulators for up to kLanes rows of x, or kRows / 2 x 2
// for more (two columns of x^T a pass), either way with a column of x and a broadcast in registers too.
#ifdef __AVX512F__
#define STRATA_GEMM_LANES 16
constexpr int kRows = 24;  // 24 + 2, or 24 + 3, of 32 zmm registers
#else
#define STRATA_GEMM_LANES 8
constexpr int kRows = 12;  // 12 + 2, or 12 + 3, of 16 ymm registers
#endif
constexpr int kLanes = STRATA_GEMM_LANES;
typedef float vec __attribute__((vector_size(4 * STRATA_GEMM_LANES)));
typedef float vecu __attribute__((vector_size(4 * STRATA_GEMM_LANES), aligned(4)));

inline vec loadv(const float* p) { return *reinterpret_cast<const vecu*>(p); }
// (a broadcast instruction: built lane by lane, GCC assembled it on the stack every time)
inline vec splatv(float s) {
#if defined(__AVX512F__)
  return reinterpret_cast<vec>(_mm512_set1_ps(s));
#elif defined(__AVX__)
  return reinterpret_cast<vec>(_mm256_set1_ps(s));
#else
  vec v;
  for (int i = 0; i < kLanes; ++i) v[i] = s;
  return v;
#endif
}
// a * b + c rounded once, whatever the compiler's contraction settings
inline vec fmav(vec a, vec b, vec c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vec>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  return reinterpret_cast<vec>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                               reinterpret_cast<__m256>(c)));
#else
  vec out;
  for (int i = 0; i < kLanes; ++i) out[i] = std::fma(a[i], b[i], c[i]);
  return out;
#endif
}

// P rows of W (``w``, row-major, ``ldw`` floats apart) against V * kLanes rows of x (``xt``: x^T, ``ld`` floats a row).
// The accumulators are locals (as an out-parameter they could alias ``w``, and GCC stored them every step).
template <int V, int P>
__attribute__((noinline)) void panel_kernel(const float* __restrict w, int64_t ldw, int64_t k, const float* __restrict xt,
                                            int64_t ld, vec (&out)[kRows][2]) {
  vec acc[P][V];
  for (int j = 0; j < P; ++j)
    for (int v = 0; v < V; ++v) acc[j][v] = vec{};
#pragma GCC unroll 1
  for (int64_t i = 0; i < k; ++i) {
    vec xv[V];
    for (int v = 0; v < V; ++v) xv[v] = loadv(xt + i * ld + v * kLanes);
#pragma GCC unroll 32
    for (int j = 0; j < P; ++j) {
      const vec wj = splatv(w[j * ldw + i]);
      for (int v = 0; v < V; ++v) acc[j][v] = fmav(wj, xv[v], acc[j][v]);
    }
  }
  for (int j = 0; j < P; ++j)
    for (int v = 0; v < V; ++v) out[j][v] = acc[j][v];
}

}  // namespace

// Rows of a quantized W as fp32, one at a time: ``row_fn(args, row, out)`` writes W[row, 0 .. K) to out.
using DequantRow = void (*)(const void* args, int64_t row, float* out);

// x [M, K] fp32 contiguous; W [N, K] given by ``row_fn``; bias [N] or null. Returns y [M, N] fp32.
at::Tensor dequant_gemm(const at::Tensor& x, int64_t n, const float* bias, DequantRow row_fn, const void* args) {
  const int64_t m = x.size(0), k = x.size(1);
  const int vectors = m <= kLanes ? 1 : 2;  // columns of x^T a pass: one vector while x fits in it
  const int64_t cols = vectors * kLanes, ld = (m + cols - 1) / cols * cols;
  std::vector<float> xt(static_cast<size_t>(k * ld), 0.f);  // x^T, rows past M zero
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) xt[i * ld + r] = xp[r * k + i];
  at::Tensor y = at::empty({m, n}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t panels = (n + kRows - 1) / kRows;
  // the buffer's rows 64 bytes past a multiple of 64: rows a power of two apart would share the L1 sets
  const int64_t ldw = (k + 15) / 16 * 16 + 16;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> w(static_cast<size_t>(kRows * ldw), 0.f);
    vec acc[kRows][2];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t row0 = p * kRows, rows = std::min<int64_t>(kRows, n - row0);
      for (int j = 0; j < rows; ++j) row_fn(args, row0 + j, w.data() + j * ldw);
      if (rows < kRows) std::fill(w.begin() + rows * ldw, w.end(), 0.f);
      for (int64_t c0 = 0; c0 < m; c0 += cols) {
        if (vectors == 1) {
          panel_kernel<1, kRows>(w.data(), ldw, k, xt.data() + c0, ld, acc);
        } else {  // two halves of the rows, each against two vectors of x^T (the halves' results kept apart)
          vec half[kRows][2];
          panel_kernel<2, kRows / 2>(w.data(), ldw, k, xt.data() + c0, ld, acc);
          panel_kernel<2, kRows / 2>(w.data() + kRows / 2 * ldw, ldw, k, xt.data() + c0, ld, half);
          for (int j = 0; j < kRows / 2; ++j) {
            acc[kRows / 2 + j][0] = half[j][0];
            acc[kRows / 2 + j][1] = half[j][1];
          }
        }
        const int64_t here = std::min<int64_t>(cols, m - c0);
        for (int j = 0; j < rows; ++j) {
          const float b = bias != nullptr ? bias[row0 + j] : 0.f;
          for (int64_t c = 0; c < here; ++c) yp[(c0 + c) * n + row0 + j] = acc[j][c / kLanes][c % kLanes] + b;
        }
      }
    }
  });
  return y;
}

namespace {

struct DenseRows {
  const void* w;
  bool bf16;
  int64_t k;
};

// a row of a dense fp32 or bf16 W, as fp32 (a copy: the buffer's padded rows keep clear of L1 set conflicts)
void dense_row(const void* p, int64_t row, float* out) {
  const DenseRows& a = *static_cast<const DenseRows*>(p);
  if (!a.bf16) {
    std::memcpy(out, static_cast<const float*>(a.w) + row * a.k, a.k * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(a.w) + row * a.k;
  for (int64_t i = 0; i < a.k; ++i) {
    const uint32_t bits = static_cast<uint32_t>(h[i]) << 16;
    std::memcpy(out + i, &bits, 4);
  }
}

}  // namespace

// x [M, K] fp32; w [N, K] fp32 or bf16, contiguous; bias [N] fp32 or empty. Returns y [M, N] fp32: the GEMM
// above on a dense W (decode batches past the streaming kernel's rows).
at::Tensor dense_gemm_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(0) >= 1,
              "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1) &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16), "w must be contiguous fp32 or bf16 [N, K]");
  const int64_t n = w.size(0);
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n),
              "bias must be fp32 [N]");
  const DenseRows rows{w.data_ptr(), w.scalar_type() == at::kBFloat16, x.size(1)};
  return dequant_gemm(x, n, bias.numel() > 0 ? bias.data_ptr<float>() : nullptr, &dense_row, &rows);
}

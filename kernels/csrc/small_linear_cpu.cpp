// y = x W^T + b for a handful of rows of x (a small decode batch): a weight-streaming GEMV.
//
// With one to a few tokens per step, a linear layer reads its whole weight matrix to do very little
// arithmetic, so its speed is the speed of streaming W from memory. Each thread takes a contiguous
// range of output rows, reads those rows of W once, front to back (what hardware prefetchers follow
// best), and dots each with every row of x held in L1, with four independent vector accumulators of the
// machine's width per dot (rows grouped so those accumulators stay in registers). W may be fp32 or bf16
// (widened in registers); accumulation is fp32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Native vector width: a wider GCC vector type than the machine has is split by the compiler, which then
// keeps the accumulators in memory (measured: 4x slower on an AVX2 CPU than native 8-lane vectors).
#ifdef __AVX512F__
#define STRATA_LANES 16
constexpr int kGroup = 4;  // rows per pass: 4 x 4 accumulators + 4 weights of 32 zmm registers
#else
#define STRATA_LANES 8
constexpr int kGroup = 2;  // 2 x 4 accumulators + 4 weights of 16 ymm registers
#endif
constexpr int kLanes = STRATA_LANES;
typedef float vec __attribute__((vector_size(4 * STRATA_LANES)));
typedef float vecu __attribute__((vector_size(4 * STRATA_LANES), aligned(4)));
typedef uint16_t hvecu __attribute__((vector_size(2 * STRATA_LANES), aligned(2)));
typedef uint32_t uvec __attribute__((vector_size(4 * STRATA_LANES)));

constexpr int kMaxRows = 8;

inline vec load(const float* p) { return *reinterpret_cast<const vecu*>(p); }
inline vec load(const at::BFloat16* p) {
  const hvecu h = *reinterpret_cast<const hvecu*>(p);
  const uvec wide = __builtin_convertvector(h, uvec) << 16;
  return reinterpret_cast<const vec&>(wide);
}
inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

inline float hsum(vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// G rows of x dotted with one row of W. Each row keeps four accumulators over all of K, summed in one
// fixed order, so a row's result does not depend on how many rows come with it (batch invariance: a
// token is computed the same alone, in a batch, or in a speculative draft). A group after the first
// reads the W row again, from L1.
template <int G, typename W>
inline void dot_rows(const float* x, int64_t k, const W* wr, float* out) {
  constexpr int kStep = 4 * kLanes;
  vec acc[G][4];
  for (int r = 0; r < G; ++r)
    for (int a = 0; a < 4; ++a) acc[r][a] = vec{};
  int64_t i = 0;
  for (; i + kStep <= k; i += kStep) {
    const vec w0 = load(wr + i), w1 = load(wr + i + kLanes), w2 = load(wr + i + 2 * kLanes),
              w3 = load(wr + i + 3 * kLanes);
    for (int r = 0; r < G; ++r) {
      const float* xr = x + r * k + i;
      acc[r][0] += w0 * load(xr);
      acc[r][1] += w1 * load(xr + kLanes);
      acc[r][2] += w2 * load(xr + 2 * kLanes);
      acc[r][3] += w3 * load(xr + 3 * kLanes);
    }
  }
  for (; i + kLanes <= k; i += kLanes) {
    const vec w0 = load(wr + i);
    for (int r = 0; r < G; ++r) acc[r][0] += w0 * load(x + r * k + i);
  }
  for (int r = 0; r < G; ++r) {
    float s = hsum((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]));
    for (int64_t j = i; j < k; ++j) s += widen(wr[j]) * x[r * k + j];
    out[r] = s;
  }
}

template <typename W>
void rows_range(const float* x, int64_t m, int64_t k, const W* w, const float* bias, float* y, int64_t n_total,
                int64_t n0, int64_t n1) {
  float out[kMaxRows];
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * k;
    int64_t r = 0;
    for (; r + kGroup <= m; r += kGroup) dot_rows<kGroup>(x + r * k, k, wr, out + r);
    for (; r < m; ++r) dot_rows<1>(x + r * k, k, wr, out + r);
    const float b = bias != nullptr ? bias[n] : 0.f;
    for (r = 0; r < m; ++r) y[r * n_total + n] = out[r] + b;
  }
}

}  // namespace

// x [M, K] fp32 contiguous (M <= 8), w [N, K] fp32 or bf16 contiguous, bias [N] fp32 or empty;
// returns y [M, N] fp32.
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(x.size(0) <= kMaxRows, "small_linear takes at most 8 rows");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1), "w must be contiguous [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  const float* b = nullptr;
  if (bias.numel() > 0) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n, "bias must be fp32 [N]");
    b = bias.data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Split the output rows into a few large contiguous ranges: each thread streams its part of W.
  const int64_t grain = std::max<int64_t>(64, n / (4 * std::max(1, at::get_num_threads())));
  if (w.scalar_type() == at::kFloat) {
    const float* wp = w.data_ptr<float>();
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) { rows_range(xp, m, k, wp, b, yp, n, n0, n1); });
  } else if (w.scalar_type() == at::kBFloat16) {
    const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) { rows_range(xp, m, k, wp, b, yp, n, n0, n1); });
  } else {
    TORCH_CHECK(false, "w must be float32 or bfloat16");
  }
  return y;
}

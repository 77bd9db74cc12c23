// y = x W^T + b for a handful of rows of x (a small decode batch): a weight-streaming GEMV.
//
// With one to a few tokens per step, a linear layer reads its whole weight matrix to do very little
// arithmetic, so its speed is the speed of streaming W from memory. Each thread takes a contiguous
// range of output rows, reads those rows of W once, front to back (what hardware prefetchers follow
// best), and dots each with every row of x held in L1, with four independent vector accumulators per
// dot. W may be fp32 or bf16 (widened in registers); accumulation is fp32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef uint16_t h16u __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u16x32 __attribute__((vector_size(64)));

constexpr int kMaxRows = 8;

inline v16 load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline v16 load16(const at::BFloat16* p) {
  const h16u h = *reinterpret_cast<const h16u*>(p);
  const u16x32 wide = __builtin_convertvector(h, u16x32) << 16;
  return reinterpret_cast<const v16&>(wide);
}
inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

template <typename W>
void rows_range(const float* x, int64_t m, int64_t k, const W* w, const float* bias, float* y, int64_t n_total,
                int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = w + n * k;
    v16 acc[kMaxRows][4];
    for (int64_t r = 0; r < m; ++r)
      for (int a = 0; a < 4; ++a) acc[r][a] = v16{};
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
      const v16 w0 = load16(wr + i), w1 = load16(wr + i + 16), w2 = load16(wr + i + 32), w3 = load16(wr + i + 48);
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x + r * k + i;
        acc[r][0] += w0 * load16(xr);
        acc[r][1] += w1 * load16(xr + 16);
        acc[r][2] += w2 * load16(xr + 32);
        acc[r][3] += w3 * load16(xr + 48);
      }
    }
    for (; i + 16 <= k; i += 16) {
      const v16 w0 = load16(wr + i);
      for (int64_t r = 0; r < m; ++r) acc[r][0] += w0 * load16(x + r * k + i);
    }
    for (int64_t r = 0; r < m; ++r) {
      float s = hsum((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]));
      for (int64_t j = i; j < k; ++j) s += widen(wr[j]) * x[r * k + j];
      y[r * n_total + n] = s + (bias != nullptr ? bias[n] : 0.f);
    }
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

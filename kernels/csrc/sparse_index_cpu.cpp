// DSA's lightning-indexer scores (DeepSeek-V3.2) for a few query rows over every cached token, fused:
//
//   I[r, t] = sum_h w[r, h] * max(0, scale * q[r, h] . k[t])
//
// The torch reference (kernels/sparse_index.py) builds the [rows, heads, tokens] dot products first: at a
// million tokens and 64 heads that is 256 MB per row and layer, written and read back. Here each token's key
// is read once and its heads are summed in registers. Tokens split across threads; the top-k that follows
// stays torch.topk (its tie rule is transformers').

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

at::Tensor index_scores(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& weights, double scale) {
  // q: [rows, heads, dim] fp32; keys: [tokens, dim] fp32; weights: [rows, heads] fp32. Returns [rows, tokens].
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  weights.scalar_type() == at::kFloat,
              "index_scores: fp32 inputs");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && weights.is_contiguous(), "index_scores: contiguous inputs");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 2 && weights.dim() == 2, "index_scores: q [R, H, D], keys [T, D], w [R, H]");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), T = keys.size(0);
  TORCH_CHECK(keys.size(1) == D && weights.size(0) == R && weights.size(1) == H, "index_scores: shapes");
  auto out = at::empty({R, T}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  // Tiles of TILE tokens, their keys transposed to [dim][TILE] once per tile (a 1/heads share of the work), so
  // the dot products run across the tile's tokens in SIMD lanes with no horizontal sum.
  constexpr int64_t TILE = 32;
  at::parallel_for(0, (T + TILE - 1) / TILE, 1, [&](int64_t tb, int64_t te) {
    std::vector<float> kt(D * TILE);
    float dots[TILE], acc[TILE];
    for (int64_t tile = tb; tile < te; ++tile) {
      const int64_t t0 = tile * TILE, n = std::min(TILE, T - t0);
      for (int64_t d = 0; d < D; ++d)
        for (int64_t j = 0; j < TILE; ++j) kt[d * TILE + j] = j < n ? kp[(t0 + j) * D + d] : 0.f;
      for (int64_t r = 0; r < R; ++r) {
        const float* qr = qp + r * H * D;
        const float* wr = wp + r * H;
        for (int64_t j = 0; j < TILE; ++j) acc[j] = 0.f;
        for (int64_t h = 0; h < H; ++h) {
          const float* qh = qr + h * D;
          for (int64_t j = 0; j < TILE; ++j) dots[j] = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            const float qd = qh[d];
            const float* row = kt.data() + d * TILE;
            for (int64_t j = 0; j < TILE; ++j) dots[j] += qd * row[j];
          }
          const float w = wr[h];
          for (int64_t j = 0; j < TILE; ++j) {
            const float x = dots[j] * s;
            acc[j] += x > 0.f ? w * x : 0.f;
          }
        }
        for (int64_t j = 0; j < n; ++j) op[r * T + t0 + j] = acc[j];
      }
    }
  });
  return out;
}

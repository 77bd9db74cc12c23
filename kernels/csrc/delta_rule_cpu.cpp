// One decode step of the gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5; KDA: Kimi-Linear) for every
// sequence at once, reading each sequence's state from its slot of the pool and writing the new state to
// another slot.
//
// Per (sequence, value head) the state S is a [K, V] fp32 matrix. The torch reference (kernels/delta_rule.py)
// runs it as five ops over [B, H, K, V] tensors, each reading and writing the whole state, plus a gather
// from the pool before and a scatter after. Here S is read twice and written once: the first pass reads
// (D S)^T k (what the decayed state predicts for v), the second rewrites S = D S + k delta^T and reads the
// output S^T q from the new rows as they are written. Sequences x heads run in parallel. The decay D is
// exp(g) for every row of S (g: [B, H]) or exp(g_i) for row i (g: [B, H, K], KDA's per-channel decay).
//
//   delta = beta * (v - (D S)^T k)
//   S'    = D S + k delta^T
//   out   = S'^T q

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <vector>

at::Tensor delta_rule_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, at::Tensor pool, const at::Tensor& read, const at::Tensor& write) {
  // q, k: [B, H, K] fp32; v: [B, H, V] fp32; beta: [B, H] fp32; g: [B, H] or [B, H, K] fp32; pool: [slots, H, K, V] fp32, each slot's
  // [H, K, V] contiguous (a layer's view of the state pool); read, write: [B] int64 slots. Returns [B, H, V].
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat &&
                  pool.scalar_type() == at::kFloat,
              "delta_rule_step: fp32 inputs and state");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && g.is_contiguous() && beta.is_contiguous(),
              "delta_rule_step: contiguous q, k, v, g, beta");
  TORCH_CHECK(pool.dim() == 4 && pool.stride(3) == 1 && pool.stride(2) == pool.size(3) &&
                  pool.stride(1) == pool.size(2) * pool.size(3),
              "delta_rule_step: each slot's state must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), K = q.size(2), V = v.size(2);
  TORCH_CHECK(pool.size(1) == H && pool.size(2) == K && pool.size(3) == V, "delta_rule_step: pool shape");
  TORCH_CHECK(read.numel() == B && write.numel() == B, "delta_rule_step: one read and one write slot per sequence");
  const bool per_channel = g.dim() == 3;
  TORCH_CHECK(g.numel() == (per_channel ? B * H * K : B * H), "delta_rule_step: g is [B, H] or [B, H, K]");
  auto out = at::empty({B, H, V}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* sp = pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* rp = read.data_ptr<int64_t>();
  const int64_t* wp = write.data_ptr<int64_t>();
  const int64_t slot_stride = pool.stride(0);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> delta(V), decay(K);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* src = sp + rp[b] * slot_stride + h * K * V;
      float* dst = sp + wp[b] * slot_stride + h * K * V;
      const float* kk = kp + bh * K;
      const float* qq = qp + bh * K;
      for (int64_t i = 0; i < K; ++i) decay[i] = std::exp(per_channel ? gp[bh * K + i] : gp[bh]);
      const float bet = bp[bh];
      for (int64_t j = 0; j < V; ++j) delta[j] = 0.f;
      for (int64_t i = 0; i < K; ++i) {  // (D S)^T k, row by row of S
        const float ki = kk[i] * decay[i];
        const float* row = src + i * V;
        for (int64_t j = 0; j < V; ++j) delta[j] += row[j] * ki;
      }
      const float* vv = vp + bh * V;
      for (int64_t j = 0; j < V; ++j) delta[j] = bet * (vv[j] - delta[j]);
      float* o = op + bh * V;
      for (int64_t j = 0; j < V; ++j) o[j] = 0.f;
      for (int64_t i = 0; i < K; ++i) {  // S' row i, and its share of S'^T q
        const float ki = kk[i], qi = qq[i], di = decay[i];
        const float* row = src + i * V;
        float* nrow = dst + i * V;
        for (int64_t j = 0; j < V; ++j) {
          const float s = di * row[j] + ki * delta[j];
          nrow[j] = s;
          o[j] += s * qi;
        }
      }
    }
  });
  return out;
}

// The elementwise parts of a decoder layer in bf16, one pass each: RMSNorm, RoPE (rotate-half) and the
// SwiGLU gate silu(gate) * up.
//
// In eager torch each is 3-8 ops, and every op widens a bf16 tensor, computes, rounds and writes a new
// one: at a 2,048-token prefill of SmolLM2 in bf16 they took ~45% of the step, more than its GEMMs.
// Here a row is read once, computed in fp32 registers and written once. Each op rounds to bf16 exactly
// where the eager ops do (RoPE: each product, then their sum; RMSNorm: the normalised row, then its
// product with the weight; SwiGLU: silu(gate), then its product with up), with the same
// round-to-nearest-even, so RoPE is bit-identical to the eager ops, RMSNorm differs only in the order of
// its sum of squares and SwiGLU only in its exp's last bit. A row never depends on the other rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

#ifdef __AVX512F__
#define STRATA_OPS_LANES 16
#else
#define STRATA_OPS_LANES 8
#endif
constexpr int kLanes = STRATA_OPS_LANES;
typedef float vf __attribute__((vector_size(4 * STRATA_OPS_LANES)));
typedef int32_t vi __attribute__((vector_size(4 * STRATA_OPS_LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * STRATA_OPS_LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * STRATA_OPS_LANES)));
typedef uint16_t vhu __attribute__((vector_size(2 * STRATA_OPS_LANES), aligned(2)));

constexpr int64_t kGrainElems = 16384;  // below this a call stays on its thread (a decode step's rows)

inline vf splat(float v) { return vf{} + v; }

// kLanes bf16 values from p (any alignment) as fp32.
inline vf load(const uint16_t* p) {
  const vh h = *reinterpret_cast<const vhu*>(p);
  const vu wide = __builtin_convertvector(h, vu) << 16;
  return reinterpret_cast<const vf&>(wide);
}

// fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0: c10::BFloat16's conversion, lane by lane.
inline vu bf16_bits(vf x) {
  const vu u = reinterpret_cast<const vu&>(x);
  const vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const vi is_nan = x != x;  // all ones where x is NaN
  const vu nan = reinterpret_cast<const vu&>(is_nan);
  return (rounded & ~nan) | ((vu{} + 0x7FC0u) & nan);
}

// x rounded to bf16 and widened back: where an eager op would have written a bf16 tensor.
inline vf round_bf16(vf x) {
  const vu bits = bf16_bits(x) << 16;
  return reinterpret_cast<const vf&>(bits);
}

inline void store(uint16_t* p, vf x) {
  const vh h = __builtin_convertvector(bf16_bits(x), vh);
  std::memcpy(p, &h, sizeof(h));
}

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// exp in fp32 to ~1 ulp (Cephes' expf: a degree-6 polynomial after reducing by ln 2), inf above the
// range, 0 below it, as expf gives.
inline vf exp_vec(vf x) {
  const vf hi = splat(88.3762626647949f), lo = splat(-87.3365447504f);
  const vf xc = x > hi ? hi : (x < lo ? lo : x);
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer (|x| < 2^22)
  const vf n = (xc * splat(1.44269504088896341f) + magic) - magic;
  vf r = xc - n * splat(0.693359375f);
  r = r + n * splat(2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  // 2^n as 2^a * 2^b, a + b = n: n runs from -126 to 128 over the range, and 2^128 is not a float
  const vi ni = __builtin_convertvector(n, vi);
  const vi ea = ((ni >> 1) + 127) << 23, eb = ((ni - (ni >> 1)) + 127) << 23;
  vf y = p * reinterpret_cast<const vf&>(ea) * reinterpret_cast<const vf&>(eb);
  y = x > hi ? splat(INFINITY) : y;
  y = x < lo ? splat(0.f) : y;
  return x != x ? x : y;
}

// A row of n values through f in vectors; the tail goes through the same vector code on a padded copy,
// so every element is computed by the same instructions.
template <typename F>
inline void tail(int64_t n, int64_t done, const uint16_t* const* in, int ins, uint16_t* out, F f) {
  if (done >= n) return;
  uint16_t buf[4][kLanes] = {};
  uint16_t res[kLanes];
  const int64_t left = n - done;
  for (int i = 0; i < ins; ++i) std::memcpy(buf[i], in[i] + done, left * sizeof(uint16_t));
  f(buf, res);
  std::memcpy(out + done, res, left * sizeof(uint16_t));
}

const uint16_t* u16(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* u16(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name, " must be a bf16 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, "'s last dimension must be contiguous");
}

}  // namespace

// x [A, B, D] bf16 (any strides but the last), w [D] bf16 -> [A, B, D]: w * bf16(x * rsqrt(mean(x^2) + eps)).
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_bf16(x, "x");
  check_bf16(w, "w");
  TORCH_CHECK(x.dim() == 3 && w.dim() == 1 && w.size(0) == x.size(2), "rms_norm_bf16: x [A, B, D], w [D]");
  const int64_t a = x.size(0), b = x.size(1), d = x.size(2), sa = x.stride(0), sb = x.stride(1);
  at::Tensor out = at::empty({a, b, d}, x.options());
  const at::Tensor wc = w.contiguous();  // held: a copy must outlive the pointer into it
  const uint16_t *xp = u16(x), *wp = u16(wc);
  uint16_t* op = u16(out);
  const float feps = static_cast<float>(eps);
  const int64_t full = d / kLanes * kLanes;
  at::parallel_for(0, a * b, std::max<int64_t>(1, kGrainElems / std::max<int64_t>(d, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* xr = xp + (r / b) * sa + (r % b) * sb;
      uint16_t* orow = op + r * d;
      vf acc[4] = {};
      int64_t i = 0;
      for (; i + 4 * kLanes <= full; i += 4 * kLanes)
        for (int j = 0; j < 4; ++j) {
          const vf v = load(xr + i + j * kLanes);
          acc[j] += v * v;
        }
      for (; i < full; i += kLanes) {
        const vf v = load(xr + i);
        acc[0] += v * v;
      }
      float ss = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
      for (; i < d; ++i) {
        const float v = static_cast<float>(reinterpret_cast<const at::BFloat16*>(xr)[i]);
        ss += v * v;
      }
      const float mean = ss / static_cast<float>(d);
      const vf inv = splat(1.0f / std::sqrt(mean + feps));
      auto row = [&](const vf xv, const vf wv) { return wv * round_bf16(xv * inv); };
      for (i = 0; i < full; i += kLanes) store(orow + i, row(load(xr + i), load(wp + i)));
      const uint16_t* ins[2] = {xr, wp};
      tail(d, full, ins, 2, orow, [&](uint16_t (*buf)[kLanes], uint16_t* res) {
        store(res, row(load(buf[0]), load(buf[1])));
      });
    }
  });
  return out;
}

// x [T, H, D] bf16 (any strides but the last), cos and sin_signed [T, D] bf16 -> [T, H, D]:
// bf16(bf16(x * cos) + bf16(swap_halves(x) * sin_signed)), the eager ops' roundings.
at::Tensor rope_bf16(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed) {
  check_bf16(x, "x");
  check_bf16(cos, "cos");
  check_bf16(sin_signed, "sin_signed");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "rope_bf16: x [T, H, D] with D even");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin_signed.sizes() && cos.size(0) == x.size(0) &&
              cos.size(1) == x.size(2), "rope_bf16: cos and sin_signed [T, D]");
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2), half = d / 2, st = x.stride(0), sh = x.stride(1);
  const at::Tensor c = cos.contiguous(), s = sin_signed.contiguous();
  at::Tensor out = at::empty({t, h, d}, x.options());
  const uint16_t *xp = u16(x), *cp = u16(c), *sp = u16(s);
  uint16_t* op = u16(out);
  const int64_t full = half / kLanes * kLanes;
  auto rot = [](vf own, vf other, vf cv, vf sv) { return round_bf16(own * cv) + round_bf16(other * sv); };
  at::parallel_for(0, t * h, std::max<int64_t>(1, kGrainElems / d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t ti = r / h;
      const uint16_t* xr = xp + ti * st + (r % h) * sh;
      const uint16_t *cr = cp + ti * d, *sr = sp + ti * d;
      uint16_t* orow = op + r * d;
      for (int64_t i = 0; i < full; i += kLanes) {
        const vf lo = load(xr + i), hi = load(xr + half + i);
        store(orow + i, rot(lo, hi, load(cr + i), load(sr + i)));
        store(orow + half + i, rot(hi, lo, load(cr + half + i), load(sr + half + i)));
      }
      const uint16_t* first[4] = {xr, xr + half, cr, sr};
      tail(half, full, first, 4, orow, [&](uint16_t (*buf)[kLanes], uint16_t* res) {
        store(res, rot(load(buf[0]), load(buf[1]), load(buf[2]), load(buf[3])));
      });
      const uint16_t* second[4] = {xr + half, xr, cr + half, sr + half};
      tail(half, full, second, 4, orow + half, [&](uint16_t (*buf)[kLanes], uint16_t* res) {
        store(res, rot(load(buf[0]), load(buf[1]), load(buf[2]), load(buf[3])));
      });
    }
  });
  return out;
}

// gate_up [T, 2I] bf16 (gate then up, as the fused projection writes them) -> [T, I]:
// bf16(bf16(silu(gate)) * up), silu(g) = g / (1 + exp(-g)) in fp32 as torch's kernel computes it.
at::Tensor silu_mul_bf16(const at::Tensor& gate_up) {
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul_bf16: gate_up [T, 2I]");
  const int64_t t = gate_up.size(0), n = gate_up.size(1) / 2, st = gate_up.stride(0);
  at::Tensor out = at::empty({t, n}, gate_up.options());
  const uint16_t* gp = u16(gate_up);
  uint16_t* op = u16(out);
  const int64_t full = n / kLanes * kLanes;
  auto swiglu = [](vf g, vf u) { return round_bf16(g / (splat(1.0f) + exp_vec(-g))) * u; };
  at::parallel_for(0, t, std::max<int64_t>(1, kGrainElems / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t *g = gp + r * st, *u = g + n;
      uint16_t* orow = op + r * n;
      for (int64_t i = 0; i < full; i += kLanes) store(orow + i, swiglu(load(g + i), load(u + i)));
      const uint16_t* ins[2] = {g, u};
      tail(n, full, ins, 2, orow, [&](uint16_t (*buf)[kLanes], uint16_t* res) {
        store(res, swiglu(load(buf[0]), load(buf[1])));
      });
    }
  });
  return out;
}

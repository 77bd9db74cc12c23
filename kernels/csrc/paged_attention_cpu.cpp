// Paged attention on the CPU: queries of many sequences against keys and values read in place from
// the block-major KV pool (no gather), with an online softmax and an optional log-sum-exp output.
//
// One call covers every selected sequence of a step. A work item is (sequence, tile of query rows)
// with every head, spread over ATen's thread pool. With fewer items than threads, a long decode is split
// by keys into one item per thread, merged by log-sum-exp after (flash-decoding). Keys are visited block by block, one vector width at
// a time (16 keys with AVX-512, 8 with AVX2): a token's K row (all kv heads) is contiguous in the pool,
// so a group of keys is read once and serves every query row of the tile. Per (row, head) the group's
// scores come from one partial dot per key
// products folded by a shuffle tree into one vector (no per-key horizontal sum), the softmax update
// runs on that vector, and the weighted sum of V accumulates in registers. Accumulation is fp32;
// caches may be fp32, bf16 or e4m3 (an fp8 KV cache; widened once per key group). Shapes the vector path does not cover
// (head dim or block size not a multiple of the vector width) take a plain scalar loop with the same math.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {

// Vectors of the machine's width, and key groups of that many keys: a wider GCC vector type than the
// hardware has is split by the compiler, which then keeps the key group's partial sums in memory.
#ifdef __AVX512F__
#define STRATA_LANES 16
#else
#define STRATA_LANES 8
#endif
typedef float vec __attribute__((vector_size(4 * STRATA_LANES)));
typedef float vecu __attribute__((vector_size(4 * STRATA_LANES), aligned(4)));  // unaligned loads and stores
typedef int32_t ivec __attribute__((vector_size(4 * STRATA_LANES)));

constexpr int kLanes = STRATA_LANES;
constexpr int kMaxHeadDim = 1024;  // MLA reads a 576-value latent (512 + 64) as its one head
constexpr int kRowTile = 16;  // query rows per work item (prefill chunks)
constexpr int64_t kMinSplitKeys = 4096;  // a decode is split over threads only in parts of at least this many keys
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Flush denormals to zero while a worker runs: softmax weights of far-below-max keys times small
// values land in the denormal range, where x86 arithmetic is ~100x slower; their contribution is
// below 2^-126 of the result either way. The caller's floating-point state is restored after.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
#endif
};

inline vec load(const float* p) { return *reinterpret_cast<const vecu*>(p); }
inline void store(float* p, vec v) { *reinterpret_cast<vecu*>(p) = v; }
inline vec splat(float x) { return vec{} + x; }

struct Geometry {
  int64_t heads_q, heads_kv, head_dim, block_size;
  int64_t k_block_stride, k_token_stride;
  int64_t v_block_stride, v_token_stride;
  int64_t table_stride;
  float scale;
  int64_t window;  // <= 0: no sliding window
};

// What one work item attends over and where it writes: keys [key_lo, key_hi) (absolute positions; a
// decode split over threads gives each part a range), rows written from out_first (of out and lse).
struct Span {
  int64_t key_lo, key_hi, out_first;
};

// kLanes vectors of partial sums -> one vector whose lane t is the full sum of vector t.
// Each level adds neighbouring lanes and interleaves two inputs, halving the vector count.
#if STRATA_LANES == 16
inline vec fold(const vec* p) {
  vec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(c[0], c[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
#else
inline vec fold(const vec* p) {
  vec a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);
}
#endif

// exp(x) lane-wise for x <= 0 or -inf (softmax weights after subtracting the running max): Cody-Waite
// range reduction, the degree-6 polynomial of Cephes expf (~1 ulp), the power of two built in the
// exponent bits. Below -87 the result is 0 (the true value is under 2^-125).
inline vec exp_nonpositive(vec x) {
  const vec lo = splat(-87.f);
  const vec c = x < lo ? lo : x;
  const vec magic = splat(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vec n = (c * 1.44269504088896341f + magic) - magic;
  vec r = c - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  const vec y = p * reinterpret_cast<const vec&>(bits);
  return x < lo ? vec{} : y;
}

inline float lane_max(vec v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

inline float lane_sum(vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Rows of K/V for `count` tokens starting at `src` as fp32: the pool itself for an fp32 cache,
// widened into `buf` for bf16. Returns the row pointer and its stride in floats.
inline const float* widen(const float* src, int64_t, int64_t stride, int64_t, float*, int64_t* out_stride) {
  *out_stride = stride;
  return src;
}
inline const float* widen(const at::BFloat16* src, int64_t count, int64_t stride, int64_t width, float* buf,
                          int64_t* out_stride) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t i = 0; i < width; ++i) buf[t * width + i] = static_cast<float>(src[t * stride + i]);
  *out_stride = width;
  return buf;
}

// e4m3 bytes to fp32 through a 256-entry table (exact: every code has one value), one load a value.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i)
      value[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
};
inline const float* widen(const c10::Float8_e4m3fn* src, int64_t count, int64_t stride, int64_t width, float* buf,
                          int64_t* out_stride) {
  static const Fp8Table table;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src);
  for (int64_t t = 0; t < count; ++t)
    for (int64_t i = 0; i < width; ++i) buf[t * width + i] = table.value[bytes[t * stride + i]];
  *out_stride = width;
  return buf;
}

// Ask for a key group's rows (`width` elements each) ahead of use: a block is a few pages of the pool
// far from the previous one, where the hardware prefetcher has nothing to go on.
template <typename KV>
inline void prefetch_rows(const KV* first, int64_t stride, int64_t width) {
  const int64_t bytes = width * static_cast<int64_t>(sizeof(KV));
  for (int t = 0; t < kLanes; ++t) {
    const char* row = reinterpret_cast<const char*>(first + t * stride);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
  }
}

// Per-(row, head) softmax state of one work item.
struct State {
  std::vector<float> m, l, acc, q;
  State(int64_t rows, int64_t dim) : m(rows, kNegInf), l(rows, 0.f), acc(rows * dim, 0.f), q(rows * dim) {}
};

// The vector path: head dim HD (a multiple of the vector width), key groups of that width.
template <typename KV, int HD>
void attend_tile_vec(const float* q, float* out, float* lse, const KV* kc, const KV* vc, const int32_t* table,
                     int64_t q_first_row, int64_t q_len, int64_t seq_len, int64_t kv_offset, int64_t row0,
                     int64_t row1, const Span& span, const Geometry& g) {
  constexpr int C = HD / kLanes;
  const int64_t Hq = g.heads_q, Hkv = g.heads_kv, G = Hq / Hkv, bs = g.block_size;
  const int64_t tile_rows = row1 - row0;
  State st(tile_rows * Hq, HD);
  for (int64_t r = 0; r < tile_rows; ++r)
    for (int64_t i = 0; i < Hq * HD; ++i) st.q[r * Hq * HD + i] = q[(q_first_row + row0 + r) * Hq * HD + i] * g.scale;
  std::vector<float> kbuf(std::is_same<KV, float>::value ? 0 : kLanes * Hkv * HD);
  std::vector<float> vbuf(kbuf.size());
  const int64_t first_pos = seq_len - q_len;  // absolute position of query row 0
  const int64_t last_pos = first_pos + row1 - 1;
  int64_t lo_key = std::max(kv_offset, span.key_lo);
  if (g.window > 0) lo_key = std::max(lo_key, first_pos + row0 - g.window + 1);
  const int64_t first_group = (lo_key - kv_offset) / kLanes;
  const int64_t end_group = (std::min(last_pos + 1, span.key_hi) - kv_offset + kLanes - 1) / kLanes;
  vec iota;
  for (int t = 0; t < kLanes; ++t) iota[t] = static_cast<float>(t);
  for (int64_t grp = first_group; grp < end_group; ++grp) {
    const int64_t key0 = kv_offset + grp * kLanes;
    const int64_t block = (grp * kLanes) / bs, in_block = (grp * kLanes) % bs;
    const int64_t nkeys = std::min<int64_t>(kLanes, last_pos - key0 + 1);
    if (grp + 1 < end_group) {  // the next group's rows live in another block: start fetching them now
      const int64_t nb = ((grp + 1) * kLanes) / bs, ni = ((grp + 1) * kLanes) % bs;
      prefetch_rows(kc + table[nb] * g.k_block_stride + ni * g.k_token_stride, g.k_token_stride, Hkv * HD);
      prefetch_rows(vc + table[nb] * g.v_block_stride + ni * g.v_token_stride, g.v_token_stride, Hkv * HD);
    }
    int64_t ks, vs;
    const float* kp = widen(kc + table[block] * g.k_block_stride + in_block * g.k_token_stride, nkeys,
                            g.k_token_stride, Hkv * HD, kbuf.data(), &ks);
    const float* vp = widen(vc + table[block] * g.v_block_stride + in_block * g.v_token_stride, nkeys,
                            g.v_token_stride, Hkv * HD, vbuf.data(), &vs);
    for (int64_t r = 0; r < tile_rows; ++r) {
      const int64_t pos = first_pos + row0 + r;
      const int64_t k_hi = std::min(nkeys, pos - key0 + 1);  // visible keys of the row: [k_lo, k_hi)
      const int64_t k_lo = g.window > 0 ? std::max<int64_t>(0, pos - g.window + 1 - key0) : 0;
      if (k_hi <= k_lo) continue;
      const auto visible = (iota >= static_cast<float>(k_lo)) & (iota < static_cast<float>(k_hi));
      for (int64_t head = 0; head < Hq; ++head) {
        const int64_t row = r * Hq + head;
        const int64_t koff = (head / G) * HD;
        vec qv[C];
        for (int c = 0; c < C; ++c) qv[c] = load(st.q.data() + row * HD + c * kLanes);
        vec part[kLanes];
        for (int t = 0; t < kLanes; ++t) {
          if (t >= nkeys) { part[t] = vec{}; continue; }
          const float* krow = kp + t * ks + koff;
          vec s = qv[0] * load(krow);
          for (int c = 1; c < C; ++c) s += qv[c] * load(krow + c * kLanes);
          part[t] = s;
        }
        const vec scores = visible ? fold(part) : splat(kNegInf);
        const float new_m = std::max(st.m[row], lane_max(scores));
        const float correction = std::exp(st.m[row] - new_m);  // exp(-inf) = 0 on the first group
        const vec p = exp_nonpositive(scores - new_m);
        st.l[row] = st.l[row] * correction + lane_sum(p);
        st.m[row] = new_m;
        float* a = st.acc.data() + row * HD;
        vec acc[C];
        for (int c = 0; c < C; ++c) acc[c] = load(a + c * kLanes) * correction;
        for (int64_t t = k_lo; t < k_hi; ++t) {
          const float* vrow = vp + t * vs + koff;
          for (int c = 0; c < C; ++c) acc[c] += p[t] * load(vrow + c * kLanes);
        }
        for (int c = 0; c < C; ++c) store(a + c * kLanes, acc[c]);
      }
    }
  }
  for (int64_t r = 0; r < tile_rows; ++r)
    for (int64_t head = 0; head < Hq; ++head) {
      const int64_t row = r * Hq + head;
      const int64_t out_row = (span.out_first + r) * Hq + head;
      const float inv = st.l[row] > 0.f ? 1.f / st.l[row] : 0.f;
      for (int64_t d = 0; d < HD; ++d) out[out_row * HD + d] = st.acc[row * HD + d] * inv;
      if (lse != nullptr) lse[out_row] = st.l[row] > 0.f ? st.m[row] + std::log(st.l[row]) : kNegInf;
    }
}

// The scalar path: any head dim and block size, the same online softmax one key at a time.
template <typename KV>
void attend_tile_scalar(const float* q, float* out, float* lse, const KV* kc, const KV* vc, const int32_t* table,
                        int64_t q_first_row, int64_t q_len, int64_t seq_len, int64_t kv_offset, int64_t row0,
                        int64_t row1, const Span& span, const Geometry& g) {
  const int64_t Hq = g.heads_q, G = Hq / g.heads_kv, D = g.head_dim, bs = g.block_size;
  const int64_t first_pos = seq_len - q_len;
  for (int64_t r = row0; r < row1; ++r) {
    const int64_t pos = first_pos + r;
    const int64_t lo = std::max(span.key_lo, g.window > 0 ? std::max(kv_offset, pos - g.window + 1) : kv_offset);
    const int64_t hi = std::min(pos, span.key_hi - 1);
    for (int64_t head = 0; head < Hq; ++head) {
      const float* qr = q + ((q_first_row + r) * Hq + head) * D;
      const int64_t koff = (head / G) * D;
      float m = kNegInf, l = 0.f;
      std::vector<float> acc(D, 0.f);
      for (int64_t key = lo; key <= hi; ++key) {
        const int64_t rel = key - kv_offset;
        const KV* krow = kc + table[rel / bs] * g.k_block_stride + (rel % bs) * g.k_token_stride + koff;
        const KV* vrow = vc + table[rel / bs] * g.v_block_stride + (rel % bs) * g.v_token_stride + koff;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qr[d] * static_cast<float>(krow[d]);
        s *= g.scale;
        const float new_m = std::max(m, s);
        const float correction = std::exp(m - new_m), p = std::exp(s - new_m);
        l = l * correction + p;
        for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * correction + p * static_cast<float>(vrow[d]);
        m = new_m;
      }
      const int64_t out_row = (span.out_first + r - row0) * Hq + head;
      for (int64_t d = 0; d < D; ++d) out[out_row * D + d] = l > 0.f ? acc[d] / l : 0.f;
      if (lse != nullptr) lse[out_row] = l > 0.f ? m + std::log(l) : kNegInf;
    }
  }
}

template <typename KV>
using TileFn = void (*)(const float*, float*, float*, const KV*, const KV*, const int32_t*, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, const Span&, const Geometry&);

template <typename KV>
TileFn<KV> tile_for(const Geometry& g) {
  if (g.block_size % kLanes == 0) {
    switch (g.head_dim) {
      case 16: return attend_tile_vec<KV, 16>;
      case 32: return attend_tile_vec<KV, 32>;
      case 64: return attend_tile_vec<KV, 64>;
      case 128: return attend_tile_vec<KV, 128>;
      case 256: return attend_tile_vec<KV, 256>;
      case 576: return attend_tile_vec<KV, 576>;  // DeepSeek-V3 / Kimi-K2 MLA latent
      default: break;
    }
  }
  return attend_tile_scalar<KV>;
}

template <typename KV>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out, float* lse,
         const at::Tensor& query_start, const at::Tensor& seq_lens, const at::Tensor& kv_offsets,
         const at::Tensor& block_tables, const at::Tensor& seqs, const Geometry& g) {
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const KV* kc = k_cache.data_ptr<KV>();
  const KV* vc = v_cache.data_ptr<KV>();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* ko = kv_offsets.data_ptr<int64_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t* sel = seqs.data_ptr<int64_t>();
  const TileFn<KV> tile = tile_for<KV>(g);
  struct Item { int64_t seq, row0, row1, key_lo, key_hi, part; };  // part >= 0: a slice of a split decode
  std::vector<Item> items;
  std::vector<int64_t> split;  // per split decode: its sequence; its parts are items of that index
  constexpr int64_t kWhole = std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < seqs.numel(); ++i) {
    const int64_t s = sel[i];
    const int64_t q_len = qs[s + 1] - qs[s];
    for (int64_t r = 0; r < q_len; r += kRowTile) items.push_back({s, r, std::min(q_len, r + kRowTile), 0, kWhole, -1});
  }
  // Too few items for the threads (a lone long decode): split each short one's keys into parts, merged
  // below by their log-sum-exp (flash-decoding), so every thread reads a share of one long context.
  const int64_t threads = at::get_num_threads();
  if (!items.empty() && static_cast<int64_t>(items.size()) < threads) {
    const int64_t want = threads / static_cast<int64_t>(items.size());
    std::vector<Item> whole;
    whole.swap(items);
    for (const Item& it : whole) {
      const int64_t keys = sl[it.seq] - ko[it.seq];
      const int64_t parts = g.window > 0 || it.row1 - it.row0 > 1 ? 1 : std::min(want, keys / kMinSplitKeys);
      if (parts < 2) { items.push_back(it); continue; }
      const int64_t per = (keys / parts + kLanes - 1) / kLanes * kLanes;  // key-group aligned
      for (int64_t p = 0; p < parts; ++p)
        items.push_back({it.seq, it.row0, it.row1, ko[it.seq] + p * per,
                         p + 1 == parts ? kWhole : ko[it.seq] + (p + 1) * per, static_cast<int64_t>(split.size())});
      split.push_back(it.seq);
    }
  }
  const int64_t Hq = g.heads_q, D = g.head_dim;
  std::vector<int64_t> first_part(split.size(), -1);
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i)
    if (items[i].part >= 0 && first_part[items[i].part] < 0) first_part[items[i].part] = i;
  std::vector<float> part_out(items.size() * Hq * D * (split.empty() ? 0 : 1)), part_lse(items.size() * Hq);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    FlushDenormals ftz;
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = items[i];
      const bool part = it.part >= 0;  // a part writes its one row (normalised, with its lse) aside
      const Span span{it.key_lo, it.key_hi, part ? 0 : qs[it.seq] + it.row0};
      tile(qp, part ? part_out.data() + i * Hq * D : op, part ? part_lse.data() + i * Hq : lse, kc, vc,
           bt + it.seq * g.table_stride, qs[it.seq], qs[it.seq + 1] - qs[it.seq], sl[it.seq], ko[it.seq], it.row0,
           it.row1, span, g);
    }
  });
  for (size_t k = 0; k < split.size(); ++k) {  // each split decode's parts, merged by log-sum-exp
    const int64_t row = qs[split[k]], i0 = first_part[k];
    int64_t n = 0;
    while (i0 + n < static_cast<int64_t>(items.size()) && items[i0 + n].part == static_cast<int64_t>(k)) ++n;
    for (int64_t head = 0; head < Hq; ++head) {
      float m = kNegInf;
      for (int64_t p = 0; p < n; ++p) m = std::max(m, part_lse[(i0 + p) * Hq + head]);
      float* o = op + (row * Hq + head) * D;
      std::fill(o, o + D, 0.f);
      if (m == kNegInf) {
        if (lse != nullptr) lse[row * Hq + head] = kNegInf;
        continue;
      }
      float total = 0.f;
      for (int64_t p = 0; p < n; ++p) total += std::exp(part_lse[(i0 + p) * Hq + head] - m);
      for (int64_t p = 0; p < n; ++p) {
        const float w = std::exp(part_lse[(i0 + p) * Hq + head] - m) / total;
        const float* po = part_out.data() + ((i0 + p) * Hq + head) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * po[d];
      }
      if (lse != nullptr) lse[row * Hq + head] = m + std::log(total);
    }
  }
}

}  // namespace

// q [T, Hq, D] fp32 contiguous; k_cache/v_cache [blocks, bs, Hkv, D] (views of the pool; a token's
// heads contiguous); out [T, Hq, D] fp32 and lse [T, Hq] fp32 (or an empty tensor) are written for
// the selected sequences' rows only. query_start [S+1], seq_lens [S], kv_offsets [S] (first key
// position held in the table, block aligned), seqs [n] int64; block_tables [S, W] int32.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor out,
                     at::Tensor lse, const at::Tensor& query_start, const at::Tensor& seq_lens,
                     const at::Tensor& kv_offsets, const at::Tensor& block_tables, const at::Tensor& seqs,
                     double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat, "q must be contiguous fp32 [T, Hq, D]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat, "out must match q");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches must share a dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                  v_cache.stride(2) == v_cache.size(3),
              "a token's heads must be contiguous in the caches");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables must be int32");
  for (const auto* t : {&query_start, &seq_lens, &kv_offsets, &seqs})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "metadata vectors must be contiguous int64");
  const Geometry g{q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), k_cache.stride(0), k_cache.stride(1),
                   v_cache.stride(0), v_cache.stride(1), block_tables.size(1), static_cast<float>(scale), window};
  TORCH_CHECK(g.heads_q % g.heads_kv == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(g.head_dim <= kMaxHeadDim && k_cache.size(3) == g.head_dim, "head dim of q and the caches differ");
  float* lse_ptr = nullptr;
  if (lse.numel() > 0) {
    TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.size(0) == q.size(0) &&
                    lse.size(1) == q.size(1),
                "lse must be contiguous fp32 [T, Hq]");
    lse_ptr = lse.data_ptr<float>();
  }
  if (k_cache.scalar_type() == at::kFloat) {
    run<float>(q, k_cache, v_cache, out, lse_ptr, query_start, seq_lens, kv_offsets, block_tables, seqs, g);
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(q, k_cache, v_cache, out, lse_ptr, query_start, seq_lens, kv_offsets, block_tables, seqs, g);
  } else if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    run<c10::Float8_e4m3fn>(q, k_cache, v_cache, out, lse_ptr, query_start, seq_lens, kv_offsets, block_tables, seqs, g);
  } else {
    TORCH_CHECK(false, "KV cache dtype must be float32, bfloat16 or float8_e4m3fn");
  }
}

// y = x W^T + b for a handful of rows of x with W kept quantized: the weight-streaming GEMV of
// small_linear_cpu.cpp, reading FP8 (one byte a weight), INT4 or MXFP4 (half a byte), or GGUF's q4_0,
// q4_1 and q8_0 blocks (0.56, 0.63 and 1.06 bytes) instead of fp32.
//
// Decode is bound by reading the weights, so the fewer bytes a weight takes the faster a step can be, but
// only if widening a code costs less than the bytes it saves. So the codes are widened a chunk at a time
// (32 FP8 bytes, 8 INT4 words, 32 MXFP4 bytes: one vector load) with a few whole-vector shifts, in the
// order that is cheapest to produce, not in element order: lane j of the widened vector t holds some
// element e(t, j) of the chunk. x is permuted once per call to that same order (``Layout::slot``), so each
// widened vector meets its own x values in one FMA. Scales and offsets leave the inner loop: a block's or
// group's products of codes and x are summed first, then scaled once (an INT4 offset subtracts its
// multiple of the group's sum of x, summed once per call). Nothing dequantized reaches memory.
//
// Widening, per 32-bit lane of the loaded vector:
// * FP8 e4m3 (no infinities): byte p of a lane shifted to the top, then arithmetically right by 4 and
//   masked, is the fp32 with the sign at bit 31 and exponent and mantissa at bits 26 .. 20: the code's
//   value times 2^-120, normal and subnormal codes alike (both formats put the mantissa right below the
//   exponent). x carries 2^100 (exact; products stay clear of fp32's subnormals) and the block's scale
//   the remaining 2^20.
// * INT4: nibble s of each word (element i at bits 4i, stored as q + 8) by a shift and a mask, converted
//   to fp32 in [0, 15]; w = (nibble - 8 - zero) * scale.
// * MXFP4: the low and the high nibble of every byte looked up in a 16-entry byte table of 2 * e2m1
//   (all integers: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives), then byte p of each lane sign-extended
//   and converted; the table's factor 2 goes into the group's E8M0 scale.
// The row loop takes two rows of x at a time (four accumulators each stay in registers), and every row's
// sum runs in the same order whatever rows come with it (batch invariance, as small_linear_cpu.cpp).
// Byte lookups use AVX2 where the compiler targets it; elsewhere a portable path computes the same values.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The GEMM for more rows than the streaming kernels take (dequant_gemm_cpu.cpp): W by one row function.
using DequantRow = void (*)(const void* args, int64_t row, float* out);
at::Tensor dequant_gemm(const at::Tensor& x, int64_t n, const float* bias, DequantRow row_fn, const void* args);

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

constexpr int kMaxRows = 8;
constexpr int kRowGroup = 2;  // rows of x per pass over a W row: 2 x 4 accumulators + 8 widened vectors
constexpr float kTwoPow120 = 1.329227995784916e36f;  // 2^120
constexpr float kTwoPow100 = 1.2676506002282294e30f;  // 2^100: what x carries into the FP8 kernel
constexpr float kTwoPow20 = 1048576.f;
constexpr v8 kE2M1 = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
// a * b + c rounded once, spelled out where a sum must not depend on how the compiler contracts each
// instance (a row's bits must not depend on how many rows come with it)
inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return reinterpret_cast<v8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c)));
#else
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = std::fma(a[i], b[i], c[i]);
  return out;
#endif
}
inline v8 splat(float s) { return v8{s, s, s, s, s, s, s, s}; }
inline u32x8 load_lanes(const void* p) {
  u32x8 v;
  std::memcpy(&v, p, 32);
  return v;
}
inline v8 bits_as_float(u32x8 v) { return reinterpret_cast<v8>(v); }
inline v8 to_float(u32x8 v) { return __builtin_convertvector(reinterpret_cast<i32x8>(v), v8); }

// {a, a, a, a, b, b, b, b} by one lane permutation (built from its elements, or by a generic shuffle, GCC
// stored the halves to the stack and read the vector back: a store-forwarding stall on every group)
inline v8 halves(float a, float b) {
#if defined(__AVX2__)
  const __m128 pair = _mm_unpacklo_ps(_mm_set_ss(a), _mm_set_ss(b));
  return reinterpret_cast<v8>(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)));
#else
  return v8{a, a, a, a, b, b, b, b};
#endif
}

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

// eight e4m3 codes in element order, times 2^-120 (the tile pass below)
inline v8 fp8x8(const uint8_t* p) {
  const u32x8 b = widen_bytes(p);
  const u32x8 bits = ((b << 24) & 0x80000000u) | ((b << 20) & 0x07F00000u);
  return reinterpret_cast<v8>(bits);
}

// A factor with 2^k folded in (one multiply), unless that would overflow: then two. Either way the
// product is the exact value times the factor, rounded once or twice.
struct Folded {
  Folded(float scale, float power) : folded(scale * power), plain(scale), power(power), fold(std::isfinite(scale * power)) {}
  v8 add_to(v8 v, v8 acc) const {
    return fold ? fma8(v, splat(folded), acc) : fma8(v * splat(power), splat(plain), acc);
  }
  v8 apply(v8 v) const { return fold ? v * splat(folded) : (v * splat(power)) * splat(plain); }
  float apply(float v) const { return fold ? v * folded : (v * power) * plain; }
  float add_to(float v, float acc) const { return fold ? std::fma(v, folded, acc) : std::fma(v * power, plain, acc); }
  float folded, plain, power;
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

inline float scale_at(bool bf16, const void* base, int64_t i) {
  return bf16 ? static_cast<float>(static_cast<const at::BFloat16*>(base)[i]) : static_cast<const float*>(base)[i];
}

// ---- chunk layouts: how one vector load of codes widens, and where each element lands ----

// 32 e4m3 bytes; vector p, lane j: element 4j + p, times 2^-120.
struct Fp8Chunk {
  static constexpr int kValues = 32, kBytes = 32, kVectors = 4;
  static int slot(int e) { return 8 * (e % 4) + e / 4; }
  static float slot_factor(int) { return 1.f; }
  static void widen(const uint8_t* w, v8 (&out)[kVectors]) {
    const u32x8 v = load_lanes(w);
    const i32x8 mask = i32x8{} + static_cast<int32_t>(0x87F00000u);
    out[0] = bits_as_float(reinterpret_cast<u32x8>((reinterpret_cast<i32x8>(v << 24) >> 4) & mask));
    out[1] = bits_as_float(reinterpret_cast<u32x8>((reinterpret_cast<i32x8>(v << 16) >> 4) & mask));
    out[2] = bits_as_float(reinterpret_cast<u32x8>((reinterpret_cast<i32x8>(v << 8) >> 4) & mask));
    out[3] = bits_as_float(reinterpret_cast<u32x8>((reinterpret_cast<i32x8>(v) >> 4) & mask));
  }
};

// 8 INT4 words; vector s, lane j: element 8j + s, as word j's nibble s masked in place: q * 16^s (exact,
// under 2^31), so the slots of x for nibble s carry 16^-s (``slot_factor``) and the product is q * x. The
// top nibble is shifted down instead (masked in place it would read as a negative int32).
struct Int4Chunk {
  static constexpr int kValues = 64, kBytes = 32, kVectors = 8;
  static int slot(int e) { return 8 * (e % 8) + e / 8; }
  static float slot_factor(int slot) { return slot / 8 < 7 ? std::ldexp(1.f, -4 * (slot / 8)) : 1.f; }
  static void widen(const uint8_t* w, v8 (&out)[kVectors]) {
    const u32x8 v = load_lanes(w);
    for (int s = 0; s < 7; ++s) out[s] = to_float(v & (0xFu << (4 * s)));
    out[7] = to_float(v >> 28);
  }
};

// 2 * e2m1 for each code 0 .. 15 (code 8 is -0)
constexpr int8_t kE2M1Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 32 MXFP4 bytes (64 codes, two groups); vector 4h + p, lane j: element 2(4j + p) + h (byte 4j + p's low
// nibble for h = 0, high for h = 1), as 2 * e2m1.
struct Mxfp4Chunk {
  static constexpr int kValues = 64, kBytes = 32, kVectors = 8;
  static int slot(int e) { return 8 * (4 * (e % 2) + (e / 2) % 4) + e / 8; }
  static float slot_factor(int) { return 1.f; }
  static void lookup(u32x8 nib, u32x8& out) {
#if defined(__AVX2__)
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Twice)));
    out = reinterpret_cast<u32x8>(_mm256_shuffle_epi8(table, reinterpret_cast<__m256i>(nib)));
#else
    uint8_t in[32], res[32];
    std::memcpy(in, &nib, 32);
    for (int i = 0; i < 32; ++i) res[i] = static_cast<uint8_t>(kE2M1Twice[in[i]]);
    std::memcpy(&out, res, 32);
#endif
  }
  static v8 byte_of(u32x8 v, int p) {  // byte p of each lane, sign-extended, as fp32
    return __builtin_convertvector(reinterpret_cast<i32x8>(v << (24 - 8 * p)) >> 24, v8);
  }
  static void widen(const uint8_t* w, v8 (&out)[kVectors]) {
    const u32x8 v = load_lanes(w);
    u32x8 lo, hi;
    lookup(v & 0x0F0F0F0Fu, lo);
    lookup((v >> 4) & 0x0F0F0F0Fu, hi);
    for (int p = 0; p < 4; ++p) out[p] = byte_of(lo, p);
    for (int p = 0; p < 4; ++p) out[4 + p] = byte_of(hi, p);
  }
};

// GGUF's 4-bit blocks (q4_0, q4_1): 16 bytes, byte i's low nibble element i and its high nibble element
// i + 16; two 8-byte widenings give the four vectors in element order (x needs no permutation).
struct GgmlQ4Chunk {
  static constexpr int kValues = 32, kBytes = 16, kVectors = 4;
  static void widen(const uint8_t* w, v8 (&out)[kVectors]) {
    const u32x8 lo = widen_bytes(w), hi = widen_bytes(w + 8);
    out[0] = to_float(lo & 0xFu);
    out[1] = to_float(hi & 0xFu);
    out[2] = to_float(lo >> 4);
    out[3] = to_float(hi >> 4);
  }
};

// GGUF's q8_0 codes: 32 int8, in element order.
struct GgmlQ8Chunk {
  static constexpr int kValues = 32, kBytes = 32, kVectors = 4;
  static v8 signed8(const uint8_t* p) {
#if defined(__AVX2__)
    __m128i b;
    std::memcpy(&b, p, 8);
    return __builtin_convertvector(reinterpret_cast<i32x8>(_mm256_cvtepi8_epi32(b)), v8);
#else
    const int8_t* q = reinterpret_cast<const int8_t*>(p);
    return v8{float(q[0]), float(q[1]), float(q[2]), float(q[3]), float(q[4]), float(q[5]), float(q[6]), float(q[7])};
#endif
  }
  static void widen(const uint8_t* w, v8 (&out)[kVectors]) {
    for (int t = 0; t < 4; ++t) out[t] = signed8(w + 8 * t);
  }
};

// x [M, K] rearranged so that the columns of every whole chunk sit in the chunk's slot order, each times
// ``factor`` and its slot's factor (columns past the last whole chunk as they are, times ``factor``).
template <class C>
std::vector<float> permute_x(const float* x, int64_t m, int64_t k, float factor) {
  std::vector<float> out(m * k);
  const int64_t whole = k / C::kValues * C::kValues;
  int slots[C::kValues];
  float factors[C::kValues];
  for (int e = 0; e < C::kValues; ++e) {
    slots[e] = C::slot(e);
    factors[e] = factor * C::slot_factor(slots[e]);
  }
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    float* o = out.data() + r * k;
    for (int64_t c = 0; c < whole; c += C::kValues)
      for (int e = 0; e < C::kValues; ++e) o[c + slots[e]] = xr[c + e] * factors[e];
    for (int64_t c = whole; c < k; ++c) o[c] = xr[c] * factor;
  }
  return out;
}

// The sums of codes times x over ``chunks`` whole chunks, for G rows of (permuted) x: a vector per row,
// lane j summing the elements that lane j's slots hold. Four accumulators a row, fixed order.
template <int G, class C, int kChunks = 0>  // kChunks > 0: that many, known at compile time (no loop)
inline void span_dot(const uint8_t* w, const float* xp, int64_t k, int64_t chunks, v8 (&part)[G]) {
  v8 acc[G][4];
  for (int r = 0; r < G; ++r)
    for (int a = 0; a < 4; ++a) acc[r][a] = v8{};
  const uint8_t* const end = w + (kChunks > 0 ? kChunks : chunks) * C::kBytes;
  for (const float* xq = xp; w < end; w += C::kBytes, xq += C::kValues) {
    v8 wv[C::kVectors];
    C::widen(w, wv);
    for (int t = 0; t < C::kVectors; ++t)
      for (int r = 0; r < G; ++r) acc[r][t % 4] += wv[t] * load8(xq + r * k + 8 * t);
  }
  for (int r = 0; r < G; ++r) part[r] = (acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]);
}

template <int G>
inline void finish(const v8 (&total)[G], const float (&tail)[G], float* out) {
  for (int r = 0; r < G; ++r) out[r] = hsum(total[r]) + tail[r];
}

// ---- one output row of W against G rows of x, per format ----
// (each compiled on its own, not inlined into the thread loop: there its loop counters spilled to the stack,
// and the chain through memory took longer than the arithmetic)

struct Fp8Args {
  const float* xp;  // permuted, times 2^100 (or 1 when x is too large for that: ``power`` then 2^120)
  int64_t k;
  const uint8_t* codes;
  const float* scale;
  int64_t scale_cols;
  const int64_t* row_block;
  int64_t block_rows, block_cols;
  float power;  // 2^120 / what x carries
};

// The sum of n codes times x, one at a time (a block's last few columns), the same code for any rows of x.
__attribute__((noinline)) float fp8_dot(const uint8_t* w, const float* x, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum = std::fma(fp8_one(w[i]), x[i], sum);
  return sum;
}

// Each block: its whole chunks and its remaining codes summed, then times the block's scale.
template <int G>
__attribute__((noinline)) void fp8_row(const Fp8Args& a, int64_t row, const float* xp, float* out) {
  const int64_t srow = a.row_block != nullptr ? a.row_block[row] : row / a.block_rows;
  const uint8_t* w = a.codes + row * a.k;
  const float* scale_row = a.scale + srow * a.scale_cols;
  v8 total[G] = {};
  float tail[G] = {};
  for (int64_t c0 = 0, j = 0; c0 < a.k; c0 += a.block_cols, ++j) {
    const int64_t c1 = std::min(a.k, c0 + a.block_cols), chunks = (c1 - c0) / Fp8Chunk::kValues;
    const Folded s(scale_row[j], a.power);
    v8 part[G];
    span_dot<G, Fp8Chunk>(w + c0, xp + c0, a.k, chunks, part);
    for (int r = 0; r < G; ++r) total[r] = s.add_to(part[r], total[r]);
    const int64_t i0 = c0 + chunks * Fp8Chunk::kValues;  // the block's codes past its whole chunks
    if (i0 < c1)
      for (int r = 0; r < G; ++r) tail[r] = s.add_to(fp8_dot(w + i0, xp + r * a.k + i0, c1 - i0), tail[r]);
  }
  finish<G>(total, tail, out);
}

// Blocks narrower than a chunk or not a multiple of 32 wide (a multiple of 4: each lane's four codes in one
// block): each chunk's lanes take their own block's scale, and codes past the whole chunks one at a time.
template <int G>
__attribute__((noinline)) void fp8_row_narrow(const Fp8Args& a, int64_t row, const float* xp, float* out) {
  const int64_t srow = a.row_block != nullptr ? a.row_block[row] : row / a.block_rows;
  const uint8_t* w = a.codes + row * a.k;
  const float* scale_row = a.scale + srow * a.scale_cols;
  const int64_t whole = a.k / Fp8Chunk::kValues * Fp8Chunk::kValues;
  v8 total[G] = {};
  float tail[G] = {};
  for (int64_t c0 = 0; c0 < whole; c0 += Fp8Chunk::kValues) {
    v8 part[G], plain, folded;
    span_dot<G, Fp8Chunk, 1>(w + c0, xp + c0, a.k, 1, part);
    bool fold = true;
    for (int j = 0; j < 8; ++j) {
      plain[j] = scale_row[(c0 + 4 * j) / a.block_cols];
      folded[j] = plain[j] * a.power;
      fold = fold && std::isfinite(folded[j]);
    }
    for (int r = 0; r < G; ++r) total[r] = fold ? fma8(part[r], folded, total[r]) : fma8(part[r] * splat(a.power), plain, total[r]);
  }
  for (int64_t i = whole; i < a.k; ++i) {
    const Folded s(scale_row[i / a.block_cols], a.power);
    for (int r = 0; r < G; ++r) tail[r] = s.add_to(fp8_dot(w + i, xp + r * a.k + i, 1), tail[r]);
  }
  finish<G>(total, tail, out);
}

enum Int4GroupKind { kWholeSpans, kGroups32, kAnyGroups };  // a multiple of 64 wide; 32 wide; other widths

struct Int4Args {
  const float* xp;  // permuted
  int64_t k;
  const int32_t* words;
  int64_t row_words;
  const void* scale;
  bool bf16;
  int64_t groups;
  const int8_t* zero;
  int64_t group;
  int64_t span;       // columns a scale vector covers: the group when it is a multiple of 64, else 64 (a chunk)
  const float* xsum;  // [M, spans, 8]: per span, lane j's sum of x (for the offsets)
  int64_t spans;
};

// Entry ``g`` of the scales (bf16 or fp32), and of the offsets: 8 plus the zero point, if any.
template <bool kBf16>
inline float scale_of(const Int4Args& a, int64_t g) {
  return kBf16 ? static_cast<float>(static_cast<const at::BFloat16*>(a.scale)[g]) : static_cast<const float*>(a.scale)[g];
}
template <bool kZero>
inline float offset_of(const Int4Args& a, int64_t g) {
  return 8.f + (kZero ? static_cast<float>(a.zero[g]) : 0.f);
}

// A span's scale and offset per lane: one group's (splat), two groups' (32 wide: lanes 0-3 in the first),
// or for other widths each lane's word's group's.
template <int kGroupKind, bool kBf16, bool kZero>
inline void span_params(const Int4Args& a, int64_t row, int64_t c0, v8& s, v8& off) {
  const int64_t base = row * a.groups;
  if (kGroupKind == kWholeSpans) {
    const int64_t g = base + c0 / a.group;
    s = splat(scale_of<kBf16>(a, g));
    off = splat(offset_of<kZero>(a, g));
  } else if (kGroupKind == kGroups32) {
    const int64_t g = base + c0 / 32;
    const float s0 = scale_of<kBf16>(a, g), s1 = scale_of<kBf16>(a, g + 1);
    s = halves(s0, s1);
    if (kZero) {
      off = halves(offset_of<kZero>(a, g), offset_of<kZero>(a, g + 1));
    } else {
      off = splat(8.f);
    }
  } else {
    for (int j = 0; j < 8; ++j) {
      const int64_t g = base + (c0 + 8 * j) / a.group;
      s[j] = scale_of<kBf16>(a, g);
      off[j] = offset_of<kZero>(a, g);
    }
  }
}

// Each span: sum of nibbles times x, minus the offsets times the span's sums of x, times the scales.
template <int G, int kGroupKind, bool kBf16, bool kZero>
__attribute__((noinline)) void int4_row(const Int4Args& a, int64_t row, const float* xp, int64_t x_row0, float* out) {
  const uint8_t* w = reinterpret_cast<const uint8_t*>(a.words + row * a.row_words);
  const int64_t whole = a.k / Int4Chunk::kValues * Int4Chunk::kValues;
  v8 total[G] = {};
  float tail[G] = {};
  const float* xs = a.xsum + x_row0 * a.spans * 8;
  for (int64_t c0 = 0; c0 < whole; c0 += a.span, xs += 8) {
    const int64_t c1 = std::min(whole, c0 + a.span);
    v8 part[G], s, off;
    if (kGroupKind == kWholeSpans) {
      span_dot<G, Int4Chunk>(w + c0 / 2, xp + c0, a.k, (c1 - c0) / Int4Chunk::kValues, part);
    } else {
      span_dot<G, Int4Chunk, 1>(w + c0 / 2, xp + c0, a.k, 1, part);
    }
    span_params<kGroupKind, kBf16, kZero>(a, row, c0, s, off);
    for (int r = 0; r < G; ++r) total[r] = fma8(s, fma8(-off, load8(xs + r * a.spans * 8), part[r]), total[r]);
  }
  for (int64_t i = whole; i < a.k; ++i) {
    const int64_t g = row * a.groups + i / a.group;
    const float q = static_cast<float>((static_cast<uint32_t>(a.words[row * a.row_words + i / 8]) >> (4 * (i % 8))) & 0xF);
    const float wv = (q - offset_of<kZero>(a, g)) * scale_of<kBf16>(a, g);
    for (int r = 0; r < G; ++r) tail[r] = std::fma(wv, xp[r * a.k + i], tail[r]);
  }
  finish<G>(total, tail, out);
}

// lane j's sum of x over each span's slots (word j of each of the span's chunks): [M, spans, 8]
std::vector<float> span_sums(const float* x, int64_t m, int64_t k, int64_t span, int64_t spans) {
  std::vector<float> out(m * spans * 8, 0.f);
  const int64_t whole = k / Int4Chunk::kValues * Int4Chunk::kValues;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < whole; c += Int4Chunk::kValues)
      for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 8; ++i) out[(r * spans + c / span) * 8 + j] += x[r * k + c + 8 * j + i];
  return out;
}

struct Mxfp4Args {
  const float* xp;  // permuted
  int64_t k;
  const uint8_t* packed;
  const uint8_t* scale;
};

// Each chunk (two groups): the sums of 2 * e2m1 times x, times half of each group's scale.
template <int G>
__attribute__((noinline)) void mxfp4_row(const Mxfp4Args& a, int64_t row, const float* xp, float* out) {
  const uint8_t* w = a.packed + row * (a.k / 2);
  const uint8_t* sc = a.scale + row * (a.k / 32);
  const int64_t whole = a.k / Mxfp4Chunk::kValues * Mxfp4Chunk::kValues;
  v8 total[G] = {};
  float tail[G] = {};
  for (int64_t c0 = 0; c0 < whole; c0 += Mxfp4Chunk::kValues) {
    v8 part[G];
    span_dot<G, Mxfp4Chunk, 1>(w + c0 / 2, xp + c0, a.k, 1, part);
    const float s0 = 0.5f * e8m0(sc[c0 / 32]), s1 = 0.5f * e8m0(sc[c0 / 32 + 1]);
    const v8 s = halves(s0, s1);
    for (int r = 0; r < G; ++r) total[r] = fma8(s, part[r], total[r]);
  }
  for (int64_t i = whole; i < a.k; ++i) {  // a last group of 32 when K is an odd multiple of 32
    const uint8_t code = (w[i / 2] >> (4 * (i % 2))) & 0xF;
    const float wv = 0.5f * static_cast<float>(kE2M1Twice[code]) * e8m0(sc[i / 32]);
    for (int r = 0; r < G; ++r) tail[r] = std::fma(wv, xp[r * a.k + i], tail[r]);
  }
  finish<G>(total, tail, out);
}

// GGUF block rows: q4_0 = 0 (w = d (q - 8)), q4_1 = 1 (w = d q + m), q8_0 = 2 (w = d q).
constexpr int kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2;
constexpr int64_t kGgmlBlockBytes[3] = {18, 20, 34};

struct GgmlArgs {
  const float* x;  // [M, K], element order
  int64_t k;
  const uint8_t* data;  // [N, K / 32 * block bytes]
  const float* xsum;  // [M, K / 32]: each block's sum of x, for the 4-bit formats' offsets
};

inline float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// Each block of 32: the sum of its codes times x, times d; the 4-bit formats' constant part (-8 d or m)
// times the block's sum of x.
template <int G, int kKind>
__attribute__((noinline)) void ggml_row(const GgmlArgs& a, int64_t row, int64_t r, float* out) {
  constexpr int64_t bb = kGgmlBlockBytes[kKind];
  const int64_t blocks = a.k / 32;
  const uint8_t* w = a.data + row * blocks * bb;
  const float* xr = a.x + r * a.k;
  const float* xs = a.xsum + r * blocks;
  v8 total[G] = {};
  float tail[G] = {};
  for (int64_t b = 0; b < blocks; ++b, w += bb) {
    const float d = half_at(w);
    v8 part[G];
    if constexpr (kKind == kQ8_0) {
      span_dot<G, GgmlQ8Chunk, 1>(w + 2, xr + 32 * b, a.k, 1, part);
    } else {
      span_dot<G, GgmlQ4Chunk, 1>(w + (kKind == kQ4_1 ? 4 : 2), xr + 32 * b, a.k, 1, part);
      const float off = kKind == kQ4_1 ? half_at(w + 2) : -8.f * d;
      for (int i = 0; i < G; ++i) tail[i] = std::fma(off, xs[i * blocks + b], tail[i]);
    }
    for (int i = 0; i < G; ++i) total[i] = fma8(splat(d), part[i], total[i]);
  }
  finish<G>(total, tail, out);
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(x.size(0) >= 1, "x needs at least one row");
}

const float* bias_of(const at::Tensor& bias, int64_t n) {
  if (bias.numel() == 0) return nullptr;
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n, "bias must be fp32 [N]");
  return bias.data_ptr<float>();
}

// y [M, N]: each thread streams its own range of W's rows; each W row meets x two rows at a time.
// ``row(G-template, args, w row, x rows from r, out)`` is the format's row function.
template <class Args, class Row>
at::Tensor stream_rows(const at::Tensor& x, int64_t n, const float* bias, const Args& args, Row row) {
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor y = at::empty({m, n}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(16, n / (4 * std::max(1, at::get_num_threads())));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    float out[kMaxRows];
    for (int64_t w = n0; w < n1; ++w) {
      int64_t r = 0;
      for (; r + kRowGroup <= m; r += kRowGroup) row(std::integral_constant<int, kRowGroup>{}, args, w, r, out + r);
      for (; r < m; ++r) row(std::integral_constant<int, 1>{}, args, w, r, out + r);
      for (r = 0; r < m; ++r) yp[r * n + w] = out[r] + (bias != nullptr ? bias[w] : 0.f);
    }
  });
  return y;
}

// Whether x can carry 2^100 into the FP8 kernel: |x| under 2^24 keeps x * 2^100 and every product of it
// with a widened code (under 2^9 * 2^-120) far inside fp32's range (a NaN in x gives NaN either way).
bool fits_two_pow_100(const float* x, int64_t count) {
  float big = 0.f;
  for (int64_t i = 0; i < count; ++i) big = std::max(big, std::fabs(x[i]));
  return big < 1.6777216e7f;
}

// ``body(row_fn)`` with the int4_row instance for a group kind, scale dtype and zero points.
template <int kKind, bool kBf16, bool kZero, class Body>
at::Tensor with_int4_row(Body body) {
  return body([](auto g, const Int4Args& a, int64_t w, int64_t r, float* out) {
    int4_row<decltype(g)::value, kKind, kBf16, kZero>(a, w, a.xp + r * a.k, r, out);
  });
}

template <int kKind, class Body>
at::Tensor with_int4_kind(bool bf16, bool zero, Body body) {
  if (bf16) return zero ? with_int4_row<kKind, true, true>(body) : with_int4_row<kKind, true, false>(body);
  return zero ? with_int4_row<kKind, false, true>(body) : with_int4_row<kKind, false, false>(body);
}

template <class Body>
at::Tensor dispatch_int4(int kind, bool bf16, bool zero, Body body) {
  if (kind == kWholeSpans) return with_int4_kind<kWholeSpans>(bf16, zero, body);
  if (kind == kGroups32) return with_int4_kind<kGroups32>(bf16, zero, body);
  return with_int4_kind<kAnyGroups>(bf16, zero, body);
}

// ---- one row of W as fp32, per format: what the C++ GEMM (dequant_gemm_cpu.cpp) and the tiles multiply by ----

struct Fp8Rows {
  const uint8_t* codes;
  const float* scale;
  int64_t scale_cols;
  const int64_t* row_block;  // each row's scale row, or null (row / block_rows)
  int64_t block_rows, block_cols, k;
};

// each block's codes times 2^-120, times its scale with the 2^120 folded in: the exact value, rounded once
void fp8_dequant_row(const void* p, int64_t row, float* o) {
  const Fp8Rows& a = *static_cast<const Fp8Rows*>(p);
  const int64_t srow = a.row_block != nullptr ? a.row_block[row] : row / a.block_rows;
  const uint8_t* w = a.codes + row * a.k;
  for (int64_t c0 = 0, j = 0; c0 < a.k; c0 += a.block_cols, ++j) {
    const int64_t c1 = std::min(a.k, c0 + a.block_cols);
    const Folded s(a.scale[srow * a.scale_cols + j], kTwoPow120);
    int64_t i = c0;
    for (; i + 8 <= c1; i += 8) *reinterpret_cast<v8u*>(o + i) = s.apply(fp8x8(w + i));
    for (; i < c1; ++i) o[i] = s.apply(fp8_one(w[i]));
  }
}

struct Int4Rows {
  const int32_t* words;
  int64_t row_words;
  const void* scale;
  bool bf16;
  const int8_t* zero;  // null: symmetric
  int64_t group, groups, k;
};

// (q - 8 - zero) * scale, a group at a time
void int4_dequant_row(const void* p, int64_t row, float* o) {
  const Int4Rows& a = *static_cast<const Int4Rows*>(p);
  const int32_t* w = a.words + row * a.row_words;
  for (int64_t g = 0; g < a.groups; ++g) {
    const int64_t c0 = g * a.group, c1 = std::min(a.k, c0 + a.group);
    const float s1 = scale_at(a.bf16, a.scale, row * a.groups + g);
    const float off1 = 8.f + (a.zero != nullptr ? static_cast<float>(a.zero[row * a.groups + g]) : 0.f);
    int64_t i = c0;
    for (; i + 8 <= c1; i += 8) {
      const v8 q = __builtin_convertvector(reinterpret_cast<i32x8>(nibbles(w[i / 8])), v8);
      *reinterpret_cast<v8u*>(o + i) = (q - splat(off1)) * splat(s1);
    }
    for (; i < c1; ++i) o[i] = (static_cast<float>((static_cast<uint32_t>(w[i / 8]) >> (4 * (i % 8))) & 0xF) - off1) * s1;
  }
}

struct Mxfp4Rows {
  const uint8_t* packed;
  const uint8_t* scale;
  int64_t k;
};

// e2m1 times the group's E8M0 scale, 32 codes a group
void mxfp4_dequant_row(const void* p, int64_t row, float* o) {
  const Mxfp4Rows& a = *static_cast<const Mxfp4Rows*>(p);
  for (int64_t g = 0; g < a.k / 32; ++g) {
    const v8 table = kE2M1 * splat(e8m0(a.scale[row * (a.k / 32) + g]));
    uint32_t words[4];
    std::memcpy(words, a.packed + row * (a.k / 2) + g * 16, 16);
    for (int q = 0; q < 4; ++q) *reinterpret_cast<v8u*>(o + g * 32 + q * 8) = e2m1x8(nibbles(words[q]), table);
  }
}

struct GgmlRows {
  const uint8_t* data;
  int64_t kind, k;
};

// GGUF blocks as ggml's dequantize_row_* (and QuantWeight.tile) compute them: d * (q - 8), d * q + m or
// d * q. An fp16 d times a code of at most 8 bits is exact in fp32, so d * q + m rounds once whether or not
// the compiler fuses it into an FMA: the same bits as the reference.
void ggml_dequant_row(const void* p, int64_t row, float* o) {
  const GgmlRows& a = *static_cast<const GgmlRows*>(p);
  const int64_t bb = kGgmlBlockBytes[a.kind], blocks = a.k / 32;
  const uint8_t* w = a.data + row * blocks * bb;
  for (int64_t blk = 0; blk < blocks; ++blk, w += bb, o += 32) {
    const float d = half_at(w);
    if (a.kind == kQ8_0) {
      for (int j = 0; j < 32; ++j) o[j] = d * static_cast<float>(static_cast<int8_t>(w[2 + j]));
    } else if (a.kind == kQ4_0) {
      for (int j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>((w[2 + j] & 0xF) - 8);
        o[j + 16] = d * static_cast<float>((w[2 + j] >> 4) - 8);
      }
    } else {
      const float m = half_at(w + 2);
      for (int j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>(w[4 + j] & 0xF) + m;
        o[j + 16] = d * static_cast<float>(w[4 + j] >> 4) + m;
      }
    }
  }
}

at::Tensor dequant_tile(int64_t r0, int64_t r1, int64_t k, DequantRow row_fn, const void* args) {
  at::Tensor out = at::empty({r1 - r0, k}, at::TensorOptions().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(r0, r1, 16, [&](int64_t a, int64_t b) {
    for (int64_t row = a; row < b; ++row) row_fn(args, row, op + (row - r0) * k);
  });
  return out;
}

}  // namespace

// x [M, K] fp32; codes [N, K] float8_e4m3fn; scale [R, C] fp32 with C = ceil(K / block_cols); row_block [N]
// int64 (each row's scale row) or empty (row / block_rows); block_cols a multiple of 4 (of 32: the fast
// path); bias [N] fp32 or empty. Returns y [M, N] fp32.
at::Tensor fp8_block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                            const at::Tensor& row_block, int64_t block_rows, int64_t block_cols, const at::Tensor& bias) {
  check_x(x);
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(block_rows > 0 && block_cols > 0 && block_cols % 4 == 0,
              "block sizes must be positive, the columns' a multiple of 4");
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
  if (m > kMaxRows) {
    const Fp8Rows rows{static_cast<const uint8_t*>(codes.data_ptr()), scale.data_ptr<float>(), scale.size(1), rb,
                       block_rows, block_cols, k};
    return dequant_gemm(x, n, bias_of(bias, n), &fp8_dequant_row, &rows);
  }
  const bool carry = fits_two_pow_100(x.data_ptr<float>(), m * k);
  const std::vector<float> xp = permute_x<Fp8Chunk>(x.data_ptr<float>(), m, k, carry ? kTwoPow100 : 1.f);
  const Fp8Args args{xp.data(), k, static_cast<const uint8_t*>(codes.data_ptr()), scale.data_ptr<float>(),
                     scale.size(1), rb, block_rows, block_cols, carry ? kTwoPow20 : kTwoPow120};
  if (block_cols % Fp8Chunk::kValues != 0) {
    return stream_rows(x, n, bias_of(bias, n), args, [](auto g, const Fp8Args& a, int64_t w, int64_t r, float* out) {
      fp8_row_narrow<decltype(g)::value>(a, w, a.xp + r * a.k, out);
    });
  }
  return stream_rows(x, n, bias_of(bias, n), args, [](auto g, const Fp8Args& a, int64_t w, int64_t r, float* out) {
    fp8_row<decltype(g)::value>(a, w, a.xp + r * a.k, out);
  });
}

// x [M, K] fp32; packed [N, ceil(K/8)] int32; scale [N, ceil(K/group)] fp32 or bf16; zero [N, groups]
// int8 or empty (symmetric); group a multiple of 8; bias [N] fp32 or empty. Returns y [M, N] fp32.
at::Tensor int4_group_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             const at::Tensor& zero, int64_t group, const at::Tensor& bias) {
  check_x(x);
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
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
  if (m > kMaxRows) {
    const Int4Rows rows{packed.data_ptr<int32_t>(), packed.size(1), scale.data_ptr(), scale.scalar_type() == at::kBFloat16,
                        zp, group, groups, k};
    return dequant_gemm(x, n, bias_of(bias, n), &int4_dequant_row, &rows);
  }
  const int64_t span = group % Int4Chunk::kValues == 0 ? group : Int4Chunk::kValues;
  const int64_t spans = std::max<int64_t>(1, (k / Int4Chunk::kValues * Int4Chunk::kValues + span - 1) / span);
  const std::vector<float> xp = permute_x<Int4Chunk>(x.data_ptr<float>(), m, k, 1.f);
  const std::vector<float> xsum = span_sums(x.data_ptr<float>(), m, k, span, spans);
  const Int4Args args{xp.data(), k, packed.data_ptr<int32_t>(), packed.size(1), scale.data_ptr(),
                      scale.scalar_type() == at::kBFloat16, groups, zp, group, span, xsum.data(), spans};
  const int kind = group % Int4Chunk::kValues == 0 ? kWholeSpans : group == 32 ? kGroups32 : kAnyGroups;
  return dispatch_int4(kind, args.bf16, zp != nullptr, [&](auto row_fn) {
    return stream_rows(x, n, bias_of(bias, n), args, [row_fn](auto g, const Int4Args& a, int64_t w, int64_t r, float* out) {
      row_fn(g, a, w, r, out);
    });
  });
}

// x [M, K] fp32 (K a multiple of 32); packed [N, K/2] uint8; scale [N, K/32] uint8 (E8M0); bias [N] fp32 or
// empty. Returns y [M, N] fp32.
at::Tensor mxfp4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& bias) {
  check_x(x);
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(k % 32 == 0, "MXFP4 needs a multiple of 32 inputs");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte && packed.size(1) == k / 2,
              "packed must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.scalar_type() == at::kByte && scale.size(0) == n &&
                  scale.size(1) == k / 32, "scale must be contiguous uint8 [N, K/32]");
  if (m > kMaxRows) {
    const Mxfp4Rows rows{packed.data_ptr<uint8_t>(), scale.data_ptr<uint8_t>(), k};
    return dequant_gemm(x, n, bias_of(bias, n), &mxfp4_dequant_row, &rows);
  }
  const std::vector<float> xp = permute_x<Mxfp4Chunk>(x.data_ptr<float>(), m, k, 1.f);
  const Mxfp4Args args{xp.data(), k, packed.data_ptr<uint8_t>(), scale.data_ptr<uint8_t>()};
  return stream_rows(x, n, bias_of(bias, n), args, [](auto g, const Mxfp4Args& a, int64_t w, int64_t r, float* out) {
    mxfp4_row<decltype(g)::value>(a, w, a.xp + r * a.k, out);
  });
}

// x [M, K] fp32 (K a multiple of 32); data [N, K / 32 * block bytes] uint8, GGUF's rows of blocks of ``kind``
// (0 q4_0, 1 q4_1, 2 q8_0); bias [N] fp32 or empty. Returns y [M, N] fp32.
at::Tensor ggml_block_linear(const at::Tensor& x, const at::Tensor& data, int64_t kind, const at::Tensor& bias) {
  check_x(x);
  const int64_t m = x.size(0), k = x.size(1), n = data.size(0);
  TORCH_CHECK(kind >= 0 && kind <= 2, "kind must be 0 (q4_0), 1 (q4_1) or 2 (q8_0)");
  TORCH_CHECK(k % 32 == 0, "GGUF blocks need a multiple of 32 inputs");
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.scalar_type() == at::kByte &&
                  data.size(1) == k / 32 * kGgmlBlockBytes[kind], "data must be contiguous uint8 [N, K/32 * block bytes]");
  if (m > kMaxRows) {
    const GgmlRows rows{data.data_ptr<uint8_t>(), kind, k};
    return dequant_gemm(x, n, bias_of(bias, n), &ggml_dequant_row, &rows);
  }
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(m * (k / 32), 0.f);
  for (int64_t i = 0; i < m * k; ++i) xsum[i / 32] += xp[i];
  const GgmlArgs args{xp, k, data.data_ptr<uint8_t>(), xsum.data()};
  auto run = [&](auto row_fn) { return stream_rows(x, n, bias_of(bias, n), args, row_fn); };
  if (kind == kQ4_0)
    return run([](auto g, const GgmlArgs& a, int64_t w, int64_t r, float* out) { ggml_row<decltype(g)::value, kQ4_0>(a, w, r, out); });
  if (kind == kQ4_1)
    return run([](auto g, const GgmlArgs& a, int64_t w, int64_t r, float* out) { ggml_row<decltype(g)::value, kQ4_1>(a, w, r, out); });
  return run([](auto g, const GgmlArgs& a, int64_t w, int64_t r, float* out) { ggml_row<decltype(g)::value, kQ8_0>(a, w, r, out); });
}

// Rows r0 .. r1 of a quantized weight as fp32 [r1 - r0, K]: the tile torch's GEMM multiplies by where the
// C++ GEMM does not apply. One pass, each row by the format's row function.

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
  const Fp8Rows rows{static_cast<const uint8_t*>(codes.data_ptr()), scale.data_ptr<float>(), scale.size(1), rb,
                     block_rows, block_cols, k};
  return dequant_tile(r0, r1, k, &fp8_dequant_row, &rows);
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
  const Int4Rows rows{packed.data_ptr<int32_t>(), packed.size(1), scale.data_ptr(), scale.scalar_type() == at::kBFloat16,
                      zero.numel() > 0 ? zero.data_ptr<int8_t>() : nullptr, group, groups, k};
  return dequant_tile(r0, r1, k, &int4_dequant_row, &rows);
}

at::Tensor mxfp4_dequant(const at::Tensor& packed, const at::Tensor& scale, int64_t r0, int64_t r1) {
  const int64_t k = packed.size(1) * 2;
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte && k % 32 == 0 &&
                  0 <= r0 && r0 <= r1 && r1 <= packed.size(0), "packed must be contiguous uint8 [N, K/2] holding rows r0 .. r1");
  TORCH_CHECK(scale.dim() == 2 && scale.is_contiguous() && scale.scalar_type() == at::kByte &&
                  scale.size(0) == packed.size(0) && scale.size(1) == k / 32, "scale must be contiguous uint8 [N, K/32]");
  const Mxfp4Rows rows{packed.data_ptr<uint8_t>(), scale.data_ptr<uint8_t>(), k};
  return dequant_tile(r0, r1, k, &mxfp4_dequant_row, &rows);
}

at::Tensor ggml_block_dequant(const at::Tensor& data, int64_t kind, int64_t k, int64_t r0, int64_t r1) {
  TORCH_CHECK(kind >= 0 && kind <= 2 && k % 32 == 0, "kind must be 0, 1 or 2 and K a multiple of 32");
  const int64_t bb = kGgmlBlockBytes[kind], blocks = k / 32;
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.scalar_type() == at::kByte && data.size(1) == blocks * bb &&
                  0 <= r0 && r0 <= r1 && r1 <= data.size(0), "data must be contiguous uint8 [N, K/32 * block bytes] holding rows r0 .. r1");
  const GgmlRows rows{data.data_ptr<uint8_t>(), kind, k};
  return dequant_tile(r0, r1, k, &ggml_dequant_row, &rows);
}

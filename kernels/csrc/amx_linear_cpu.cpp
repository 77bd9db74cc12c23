// y = x W^T + b for bf16 x and bf16 W on a CPU with AMX: a decode batch's linear on the tile unit.
//
// A decode step multiplies a few to a few dozen rows of x by every weight. In bf16 on AVX-512 cores
// that is bound by the vector FMAs (widening each weight to fp32 and one FMA per row), and torch's GEMM
// reorders W into its blocked layout on every call. AMX's TDPBF16PS does a 16 x 16 x 32 product per
// instruction, so here the arithmetic is nearly free and a step costs what reading W costs.
//
// The product is computed transposed, y^T = W x^T, so W is the tile instruction's A operand in its own
// row-major layout (16 output rows x 32 inputs, loaded with the row stride K), and only x is packed
// into the B operand's pair-interleaved layout (small, once per call). Each thread owns a contiguous
// range of 16-row output blocks and streams its part of W once for up to 32 rows of x.
//
// Batch invariance: every output element is one fp32 accumulation over K in a fixed order (32-input
// blocks in sequence, TDPBF16PS's own order inside a block), whatever the other rows of x are, so a
// token's result is the same alone, in a batch, or in a speculative draft. Like every bf16 dot product
// on AMX, bf16 subnormals read as zero.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <mutex>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define STRATA_HAVE_AMX 1
#else
#define STRATA_HAVE_AMX 0
#endif

namespace {

constexpr int64_t kTileRows = 16;  // output rows per W tile, and rows of x per x tile
constexpr int64_t kTileK = 32;     // bf16 inputs per tile row (64 bytes)
constexpr int64_t kAhead = 2 * kTileK;  // how far ahead along W's rows to prefetch

#if STRATA_HAVE_AMX

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an XSAVE feature's state
constexpr long kXfeatureXtiledata = 18;     // the tile data registers

// Linux hands a process AMX's 8 KiB of tile state only after it asks (once, for the whole process).
bool request_tile_permission() {
  static std::once_flag once;
  static bool granted = false;
  std::call_once(once, [] { granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0; });
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-3 accumulators (output block j of a pair, x group g: tile 2g + j), 4-5 the pair's W blocks,
// 6-7 the two groups of 16 x rows. ``g1`` is how many x rows the second group holds (0: none).
TileConfig tile_config(int64_t g0, int64_t g1) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    const int64_t cols = (t == 2 || t == 3 || t == 7) ? g1 : g0;  // x rows seen by this tile
    cfg.rows[t] = static_cast<uint8_t>(kTileRows);
    cfg.colsb[t] = static_cast<uint16_t>(t == 4 || t == 5 ? kTileK * 2 : (cols > 0 ? cols : 1) * 4);
  }
  return cfg;
}

// Output blocks [b, b + J) (J = 1 or 2) against the one or two x groups (G = 1 or 2), over all of K.
template <int J, int G>
void block_pair(const at::BFloat16* w, int64_t k, const at::BFloat16* xv0, const at::BFloat16* xv1, int64_t b,
                float* acc /* [J * G][16][16] */) {
  _tile_zero(0);
  if constexpr (J == 2) _tile_zero(1);
  if constexpr (G == 2) _tile_zero(2);
  if constexpr (J == 2 && G == 2) _tile_zero(3);
  const int64_t stride = k * 2;
  const at::BFloat16* w0 = w + b * kTileRows * k;
  const at::BFloat16* w1 = w0 + kTileRows * k;
  for (int64_t kb = 0, kk = 0; kk < k; ++kb, kk += kTileK) {
    if (kk + kAhead < k) {
      for (int64_t r = 0; r < kTileRows; ++r) {
        __builtin_prefetch(w0 + r * k + kk + kAhead, 0, 3);
        if constexpr (J == 2) __builtin_prefetch(w1 + r * k + kk + kAhead, 0, 3);
      }
    }
    _tile_loadd(6, xv0 + kb * kTileRows * kTileK, 64);
    if constexpr (G == 2) _tile_loadd(7, xv1 + kb * kTileRows * kTileK, 64);
    _tile_loadd(4, w0 + kk, stride);
    if constexpr (J == 2) _tile_loadd(5, w1 + kk, stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (J == 2) _tile_dpbf16ps(1, 5, 6);
    if constexpr (G == 2) _tile_dpbf16ps(2, 4, 7);
    if constexpr (J == 2 && G == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc, 64);
  if constexpr (J == 2) _tile_stored(1, acc + 256, 64);
  if constexpr (G == 2) _tile_stored(2, acc + 512, 64);
  if constexpr (J == 2 && G == 2) _tile_stored(3, acc + 768, 64);
}

// Scatter accumulator tiles ([output row][x row], transposed) into y rows m0.., adding the bias.
void write_block(const float* acc, int64_t rows, int64_t m0, int64_t n0, int64_t n_total, const float* bias, float* y) {
  for (int64_t i = 0; i < kTileRows; ++i) {
    const float b = bias != nullptr ? bias[n0 + i] : 0.f;
    for (int64_t m = 0; m < rows; ++m) y[(m0 + m) * n_total + n0 + i] = acc[i * 16 + m] + b;
  }
}

// x rows [m0, m0 + rows) (rows <= 32) as the B operand: per group of 16 rows and per 32-input block, 16
// tile rows of 64 bytes, row r holding (x[m][2r], x[m][2r + 1]) for each m of the group; a pair of bf16
// moves as one 32-bit word, so this is a transpose of [row][pair] words. Columns past a group's rows are
// never read (the tile configuration gives the x tiles only as many columns as rows).
void pack_x(const at::BFloat16* x, int64_t k, int64_t m0, int64_t rows, at::BFloat16* xv) {
  const int64_t pairs = k / 2, group_words = pairs * kTileRows;
  uint32_t* out = reinterpret_cast<uint32_t*>(xv);
  for (int64_t m = 0; m < rows; ++m) {
    const at::BFloat16* src = x + (m0 + m) * k;  // any element offset: copied, not cast, as words
    uint32_t* dst = out + (m / kTileRows) * group_words + m % kTileRows;
    for (int64_t p = 0; p < pairs; ++p) std::memcpy(dst + p * kTileRows, src + 2 * p, sizeof(uint32_t));
  }
}

#endif  // STRATA_HAVE_AMX

}  // namespace

// Whether this build and this process can use AMX's bf16 tiles.
bool amx_bf16_available() {
#if STRATA_HAVE_AMX
  return request_tile_permission();
#else
  return false;
#endif
}

// x [M, K] bf16 contiguous, w [N, K] bf16 contiguous (K a multiple of 32, N of 16), bias [N] fp32 or empty;
// returns y [M, N] fp32.
at::Tensor amx_bf16_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  TORCH_CHECK(amx_bf16_available(), "AMX bf16 tiles are not available on this CPU or kernel");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be contiguous bf16 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(1),
              "w must be contiguous bf16 [N, K]");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % kTileK == 0 && n % kTileRows == 0, "amx_bf16_linear needs K % 32 == 0 and N % 16 == 0");
  const float* b = nullptr;
  if (bias.numel() > 0) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == n, "bias must be fp32 [N]");
    b = bias.data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
#if STRATA_HAVE_AMX
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  const int64_t kb_count = k / kTileK, blocks = n / kTileRows, pairs = (blocks + 1) / 2;
  at::Tensor packed = at::empty({2 * kb_count * kTileRows * kTileK + 2}, x.options());  // + 2: word alignment slack
  at::BFloat16* xv = packed.data_ptr<at::BFloat16>();
  if (reinterpret_cast<uintptr_t>(xv) % 4 != 0) ++xv;
  const int64_t grain = std::max<int64_t>(4, pairs / (4 * std::max(1, at::get_num_threads())));
  for (int64_t m0 = 0; m0 < m; m0 += 2 * kTileRows) {  // W is streamed once per 32 rows of x
    const int64_t rows = std::min<int64_t>(m - m0, 2 * kTileRows);
    const int64_t g0 = std::min<int64_t>(rows, kTileRows), g1 = rows - g0;
    pack_x(xp, k, m0, rows, xv);
    const at::BFloat16* xv1 = xv + kb_count * kTileRows * kTileK;
    at::parallel_for(0, pairs, grain, [&](int64_t p0, int64_t p1) {
      const TileConfig cfg = tile_config(g0, g1);
      _tile_loadconfig(&cfg);
      alignas(64) float acc[4 * 256];
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t blk = 2 * p, n0 = blk * kTileRows;
        const bool pair = blk + 1 < blocks;
        if (pair && g1 > 0) block_pair<2, 2>(wp, k, xv, xv1, blk, acc);
        else if (pair) block_pair<2, 1>(wp, k, xv, xv1, blk, acc);
        else if (g1 > 0) block_pair<1, 2>(wp, k, xv, xv1, blk, acc);
        else block_pair<1, 1>(wp, k, xv, xv1, blk, acc);
        // acc tiles are laid out as [group][pair block] (tile 2g + j).
        write_block(acc, g0, m0, n0, n, b, yp);
        if (pair) write_block(acc + 256, g0, m0, n0 + kTileRows, n, b, yp);
        if (g1 > 0) {
          write_block(acc + 512, g1, m0 + kTileRows, n0, n, b, yp);
          if (pair) write_block(acc + 768, g1, m0 + kTileRows, n0 + kTileRows, n, b, yp);
        }
      }
      _tile_release();
    });
  }
#endif
  return y;
}

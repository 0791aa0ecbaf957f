// CPU backend: the fused tree-attention kernel.
//
// Work split. One work item is (batch row b, kv head h, block of stacked query rows,
// split of the key range). The G query heads x T tree rows that share kv head h are
// stacked into one row block (row r = g * T + t), so every K/V row is loaded once for all
// of them. When B * Hkv is small next to the thread count the key range is split too, and
// the partial softmax states are merged afterwards.
//
// Layouts. Scores are kept transposed, S^T[key][row], so the softmax over keys runs
// across SIMD lanes of rows: running max, sum and rescale are elementwise, with no
// horizontal reductions. The two products are register-tiled outer products that read
// K and V straight from the cache (any row stride), with no packing in float32:
//     S^T[j][r] += K[j][d] (broadcast) * Q^T[d][r] (vector over rows)   score_tile
//     O[r][d]   += P^T[j][r] (broadcast) * V[j][d] (vector over dims)   value_tile
// Q is transposed once per work item. float16 K/V blocks are widened to a float32
// scratch once per block. bfloat16, on CPUs with AVX512-BF16, multiplies bf16 pairs with
// float32 accumulation (vdpbf16ps): K is read from the cache as is, each V block is
// interleaved into pairs once, and P is rounded to bf16 for P V. Softmax math is float32.
//
// Threads. at::parallel_for is a header template: it only runs in parallel when this file
// is compiled with OpenMP (setup.py must pass -fopenmp on Linux); tests/test_op_cpu.py
// checks the built extension for it.
//
// Keys. For batch row b, keys [0, off_b) are visible to every row (the prefix) and keys
// [off_b, off_b + M) follow the mask; nothing at or beyond off_b + M is read. Only key
// blocks that overlap the window can be fully masked, so only those are checked and
// skipped, and only those pay for the mask.
//
// Non-finite values (README, "Non-finite values"). A row whose query, seen keys, seen
// values or seen biases hold a NaN or inf, or whose raw score overflows, is poisoned:
// output and lse NaN. In the softmax state l = NaN marks it; that survives every later
// block and the split merge, and write_rows turns it into the NaN row.
// - Scores. vexp keeps NaN, and a +inf score makes m = +inf and then exp(inf - inf) NaN,
//   so both reach l unaided. Prefix blocks without softcap (the hot path) hand the raw
//   Q K^T to the softmax; every row sees all of such a block, so the only added work is
//   the block minimum against -inf. Other blocks are finished first (finish_scores): a
//   score that is not finite before the softcap becomes NaN.
// - Masks select: a window entry a row does not see becomes -inf whatever its score holds
//   (NaN from a non-finite query or key included); a seen NaN or +inf bias is added and
//   poisons through the softmax.
// - Values. A non-finite V row of a prefix key reaches O through P V in every row (which
//   all see it; 0 * NaN and 0 * inf are NaN too), and write_rows poisons a row whose O is
//   not finite. In blocks overlapping the window the window keys' V rows (about T) are
//   scanned; a bad one makes the score NaN in the rows that see it, and P V reads a copy
//   of the block with that row zeroed, so the rows that do not see it are untouched.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TREE_ATTN_BF16_DOT 1
#else
#define TREE_ATTN_BF16_DOT 0
#endif

#include "backend.h"
#include "tree_attn.h"

namespace tree_attn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------------------------------
// SIMD: GCC/Clang vector extensions one native register wide, and register tiles sized
// to the register file of the ISA the extension is built for (setup.py compiles with
// -march=native on x86). A vector wider than the registers is legal C++ but not a plan:
// GCC lowers a 16-float vector on AVX2 through the stack, about 40x slower.
//
//   ISA            lanes  registers  score tile          value tile
//   AVX-512        16     32         8 keys x 2 vectors  8 rows x 2 vectors
//   AVX2           8      16         6 keys x 2 vectors  6 rows x 2 vectors
//   AArch64 NEON   4      32         8 keys x 2 vectors  8 rows x 2 vectors
//   other (SSE2)   4      16         6 keys x 2 vectors  6 rows x 2 vectors
//
// A tile's accumulators plus its loaded vectors and one broadcast fit the registers.
struct IsaTraits {
#if defined(__AVX512F__)
  static constexpr int64_t kLanes = 16;
  static constexpr int kRegisters = 32;
#elif defined(__AVX2__)
  static constexpr int64_t kLanes = 8;
  static constexpr int kRegisters = 16;
#elif defined(__aarch64__)
  static constexpr int64_t kLanes = 4;
  static constexpr int kRegisters = 32;
#else
  static constexpr int64_t kLanes = 4;
  static constexpr int kRegisters = 16;
#endif
  static constexpr bool kMany = kRegisters >= 32;
  static constexpr int kKeyTile = kMany ? 8 : 6;  // keys per score tile
  static constexpr int kRowTile = kMany ? 8 : 6;  // rows per value tile
  static constexpr int kWide = 2;                 // vectors per tile row (scores: rows; values: dims)
};

constexpr int64_t kLanes = IsaTraits::kLanes;
constexpr int kKeyTile = IsaTraits::kKeyTile;
constexpr int kRowTile = IsaTraits::kRowTile;
constexpr int kWide = IsaTraits::kWide;
// Row pitch of the scratch buffers: a whole number of vectors (scores, softmax); the value
// tiles' last rows take a shorter tile where kRowTile does not divide it.
constexpr int64_t kRowAlign = kLanes;
static_assert(kKeyTile * kWide + kWide + 1 <= IsaTraits::kRegisters, "score tile fits the registers");
static_assert(kRowTile * kWide + kWide + 1 <= IsaTraits::kRegisters, "value tile fits the registers");
// Every supported head dim (64, 96, 128, 256, 512) is a whole number of value tiles.
static_assert(32 % (kWide * kLanes) == 0, "value tiles cover every supported D");
static_assert(!TREE_ATTN_BF16_DOT || (kLanes == 16 && kLanes % kRowTile == 0),
              "the bf16 microkernels are written for 16-lane registers and whole value tiles");

using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using IVec = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
// A scalar operand of a vector operation is broadcast, and x - (+0) is x for every x (-0
// and NaN included), so this compiles to one broadcast. (0 + x is not x for x = -0, and a
// loop over the lanes compiles to inserts, lane by lane.)
inline Vec splat(float x) { return x - Vec{}; }
inline Vec vmax(Vec a, Vec b) { return a > b ? a : b; }
inline Vec vmin(Vec a, Vec b) { return a < b ? a : b; }

template <typename To, typename From>
inline To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

// exp(x) for x <= 0, the only arguments it gets (scores minus their running max, and
// -2|y| in vtanh), with ~2 ulp error; exactly 0 below -87 (and for -inf), so masked
// scores add nothing; NaN stays NaN, so a poisoned score reaches its row's sum. Range
// reduction x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial for e^r.
inline Vec vexp(Vec x) {
  const IVec keep = ~(x < -87.0f);  // true for NaN
  x = x < -87.0f ? splat(-87.0f) : x;
  const float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const Vec n = (x * 1.44269504088896341f + round_magic) - round_magic;
  const Vec r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 split hi + lo
  Vec p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Vec pow2n = bit_cast<Vec>((__builtin_convertvector(n, IVec) + 127) << 23);
  return bit_cast<Vec>(bit_cast<IVec>(p * pow2n) & keep);
}

// tanh(y) to ~2 ulp relative error for every y (measured against long double tanh). The
// softcap multiplies tanh by the cap, so the error must be relative near 0, where
// 1 - e^{-2|y|} cancels: there (|y| < 0.625) tanh(y) = y + y u P(u), u = y^2, with P a
// degree-4 minimax fit (relative error 4.4e-9 before float32 rounding); beyond it
// sign(y) (1 - e^{-2|y|}) / (1 + e^{-2|y|}), where e^{-2|y|} < 0.29.
inline Vec vtanh(Vec y) {
  const Vec a = y < 0.0f ? -y : y;
  const Vec e = vexp(-2.0f * a);
  const Vec t = (1.0f - e) / (1.0f + e);
  const Vec u = y * y;
  Vec p = splat(-5.704991985e-3f);
  p = p * u + 2.063909359e-2f;
  p = p * u + -5.373971909e-2f;
  p = p * u + 1.333144158e-1f;
  p = p * u + -3.333328068e-1f;
  const Vec odd = y + y * (u * p);
  return a < 0.625f ? odd : (y < 0.0f ? -t : t);
}

// Whether x[0, n) holds no NaN or +-inf: a value is not finite exactly when all its
// exponent bits are set. Read as integers, so it works on every storage dtype.
template <typename T>
struct ExponentBits;
template <>
struct ExponentBits<float> {
  using Int = uint32_t;
  static constexpr Int kMask = 0x7f800000u;
};
template <>
struct ExponentBits<at::Half> {
  using Int = uint16_t;
  static constexpr Int kMask = 0x7c00u;
};
template <>
struct ExponentBits<at::BFloat16> {
  using Int = uint16_t;
  static constexpr Int kMask = 0x7f80u;
};

template <typename T>
bool all_finite(const T* x, int64_t n) {
  using Int = typename ExponentBits<T>::Int;
  constexpr Int kMask = ExponentBits<T>::kMask;
  static_assert(sizeof(Int) == sizeof(T));
  Int bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    Int bits;
    std::memcpy(&bits, x + i, sizeof bits);
    bad |= Int((bits & kMask) == kMask);
  }
  return bad == 0;
}

// ---------------------------------------------------------------------------------------
// float32 microkernels: MR x NV register tiles (IsaTraits above).

// Scores are summed in blocks of kDotChunk head dims, the blocks' sums added in st. One
// running float32 sum over all D terms rounds at the size of the partial sum: when the
// terms are alike (same sign and size, as for rows constant along D) those roundings add
// up coherently, a relative error of about D/4 ulp (64 at D = 256), which the softmax
// turns into an output error beyond float32's bound. Blocks of 32 keep it near 9 ulp at
// every D (the output within the bound) for one load, add and store per accumulator a
// block, which costs nothing measurable; blocks of 16 (or 16 summed pairwise) halve it
// but cost 4-10 % of the kernel.
constexpr int64_t kDotChunk = 32;

// st[i][r] = sum_d k[i][d] * qt[d][r] for i < MR keys, r < NV * kLanes rows.
template <int MR, int NV>
inline void score_tile(const float* k, int64_t k_stride, const float* qt, int64_t rp, int64_t D, float* st) {
  for (int64_t d0 = 0; d0 < D; d0 += kDotChunk) {
    Vec acc[MR][NV] = {};
    for (int64_t d = d0; d < d0 + kDotChunk; ++d) {
      Vec q[NV];
      for (int v = 0; v < NV; ++v) q[v] = load(qt + d * rp + v * kLanes);
      for (int i = 0; i < MR; ++i) {
        const Vec kb = splat(k[i * k_stride + d]);
        for (int v = 0; v < NV; ++v) acc[i][v] += kb * q[v];
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) {
        float* dst = st + i * rp + v * kLanes;
        store(dst, d0 == 0 ? acc[i][v] : load(dst) + acc[i][v]);
      }
  }
}

// o[i][c] += sum_j pt[j][i] * vv[j][c] for i < MR rows, c < NV * kLanes dims.
template <int MR, int NV>
inline void value_tile(const float* pt, int64_t rp, const float* vv, int64_t v_stride, int64_t nj, float* o,
                       int64_t D) {
  Vec acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = load(o + i * D + v * kLanes);
  for (int64_t j = 0; j < nj; ++j) {
    Vec x[NV];
    for (int v = 0; v < NV; ++v) x[v] = load(vv + j * v_stride + v * kLanes);
    for (int i = 0; i < MR; ++i) {
      const Vec pb = splat(pt[j * rp + i]);
      for (int v = 0; v < NV; ++v) acc[i][v] += pb * x[v];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) store(o + i * D + v * kLanes, acc[i][v]);
}

// fn(std::integral_constant<int, N>{}) for N = count, 1 <= count <= MAX: a partial tile
// (the last keys or rows) runs the instantiation with exactly that many.
template <int MAX, typename Fn>
void with_count(int64_t count, Fn&& fn) {
  if constexpr (MAX > 1) {
    if (count < MAX) return with_count<MAX - 1>(count, std::forward<Fn>(fn));
  }
  fn(std::integral_constant<int, MAX>{});
}

// S^T[j][r] for nj keys and all rp rows (rp a multiple of kLanes).
void block_scores(const float* k, int64_t k_stride, int64_t nj, const float* qt, int64_t rp, int64_t D,
                  float* st) {
  for (int64_t r = 0; r < rp; r += kWide * kLanes) {
    const bool wide = r + kWide * kLanes <= rp;
    int64_t j = 0;
    for (; j + kKeyTile <= nj; j += kKeyTile) {
      if (wide) score_tile<kKeyTile, kWide>(k + j * k_stride, k_stride, qt + r, rp, D, st + j * rp + r);
      else score_tile<kKeyTile, 1>(k + j * k_stride, k_stride, qt + r, rp, D, st + j * rp + r);
    }
    if (j < nj) {
      with_count<kKeyTile - 1>(nj - j, [&](auto keys) {
        if (wide) score_tile<keys, kWide>(k + j * k_stride, k_stride, qt + r, rp, D, st + j * rp + r);
        else score_tile<keys, 1>(k + j * k_stride, k_stride, qt + r, rp, D, st + j * rp + r);
      });
    }
  }
}

// O[r][d] += sum_j P^T[j][r] V[j][d] for nj keys, rows r < nr (P^T's row pitch rp) and D
// dims (64, 96, 128, 256 or 512: a multiple of kWide * kLanes). Rows past nr are padding
// that is never written out, so they are skipped; the last rows take a shorter tile.
void block_values(const float* pt, int64_t rp, int64_t nr, const float* vv, int64_t v_stride, int64_t nj,
                  int64_t D, float* o) {
  int64_t r = 0;
  for (; r + kRowTile <= nr; r += kRowTile)
    for (int64_t d = 0; d < D; d += kWide * kLanes)
      value_tile<kRowTile, kWide>(pt + r, rp, vv + d, v_stride, nj, o + r * D + d, D);
  if (r < nr)
    for (int64_t d = 0; d < D; d += kWide * kLanes)
      with_count<kRowTile - 1>(nr - r, [&](auto rows) {
        value_tile<rows, kWide>(pt + r, rp, vv + d, v_stride, nj, o + r * D + d, D);
      });
}

#if TREE_ATTN_BF16_DOT
// ---------------------------------------------------------------------------------------
// bfloat16 microkernels (AVX512-BF16): vdpbf16ps multiplies 16 lanes of bf16 pairs and
// accumulates in float32, so the reduction dimension comes in pairs:
//     scores: pairs of head dims. K's pair is two adjacent elements of a cache row
//             (broadcast as one 32-bit word); Q is packed qp[d/2][r][2] per work item.
//     values: pairs of keys. P is packed pp[j/2][r][2] (broadcast), V vp[j/2][d][2].

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

inline __m512i broadcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return _mm512_set1_epi32(pair);
}

template <int MR, int NV>
inline void score_tile_bf16(const uint16_t* k, int64_t k_stride, const uint16_t* qp, int64_t rp, int64_t D,
                            float* st) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    __m512bh q[NV];
    for (int v = 0; v < NV; ++v) q[v] = as_bh(_mm512_loadu_si512(qp + 2 * (d2 * rp + v * kLanes)));
    for (int i = 0; i < MR; ++i) {
      const __m512bh kb = as_bh(broadcast_pair(k + i * k_stride + 2 * d2));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], kb, q[v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(st + i * rp + v * kLanes, acc[i][v]);
}

template <int MR, int NV>
inline void value_tile_bf16(const uint16_t* pp, int64_t rp, const uint16_t* vp, int64_t nj2, float* o, int64_t D) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_loadu_ps(o + i * D + v * kLanes);
  for (int64_t j2 = 0; j2 < nj2; ++j2) {
    __m512bh x[NV];
    for (int v = 0; v < NV; ++v) x[v] = as_bh(_mm512_loadu_si512(vp + 2 * (j2 * D + v * kLanes)));
    for (int i = 0; i < MR; ++i) {
      const __m512bh pb = as_bh(broadcast_pair(pp + 2 * (j2 * rp + i)));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], pb, x[v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + i * D + v * kLanes, acc[i][v]);
}

void block_scores_bf16(const uint16_t* k, int64_t k_stride, int64_t nj, const uint16_t* qp, int64_t rp, int64_t D,
                       float* st) {
  for (int64_t r = 0; r < rp; r += kWide * kLanes) {
    const bool wide = r + kWide * kLanes <= rp;
    const uint16_t* q = qp + 2 * r;
    int64_t j = 0;
    for (; j + kKeyTile <= nj; j += kKeyTile) {
      if (wide) score_tile_bf16<kKeyTile, kWide>(k + j * k_stride, k_stride, q, rp, D, st + j * rp + r);
      else score_tile_bf16<kKeyTile, 1>(k + j * k_stride, k_stride, q, rp, D, st + j * rp + r);
    }
    if (j < nj) {
      with_count<kKeyTile - 1>(nj - j, [&](auto keys) {
        if (wide) score_tile_bf16<keys, kWide>(k + j * k_stride, k_stride, q, rp, D, st + j * rp + r);
        else score_tile_bf16<keys, 1>(k + j * k_stride, k_stride, q, rp, D, st + j * rp + r);
      });
    }
  }
}

void block_values_bf16(const uint16_t* pp, int64_t rp, const uint16_t* vp, int64_t nj2, int64_t D, float* o) {
  for (int64_t r = 0; r < rp; r += kRowTile)
    for (int64_t d = 0; d < D; d += kWide * kLanes)
      value_tile_bf16<kRowTile, kWide>(pp + 2 * r, rp, vp + 2 * d, nj2, o + r * D + d, D);
}

// Interleaves the 16 lanes of a and b: [a0, b0, a1, b1, ...] as 32 bf16 (round to nearest even).
inline __m512i interleave_bf16(__m512 a, __m512 b) {
  const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a in the low 16, b in the high 16
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                         6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, halves);
}

// vp[j/2][d][2] = V[j][d] for nj cache rows (an odd count gets a zero partner row, never
// the cache row after the block, which may be an unused slot).
void pack_values(const uint16_t* v, int64_t v_stride, int64_t nj, int64_t D, uint16_t* vp) {
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                       37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < nj; j += 2) {
    const uint16_t* a = v + j * v_stride;
    const uint16_t* b = a + v_stride;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i x = _mm512_loadu_si512(a + d);
      const __m512i y = j + 1 < nj ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + 2 * ((j / 2) * D + d), _mm512_permutex2var_epi16(x, low, y));
      _mm512_storeu_si512(vp + 2 * ((j / 2) * D + d + 16), _mm512_permutex2var_epi16(x, high, y));
    }
  }
}
#endif  // TREE_ATTN_BF16_DOT

// ---------------------------------------------------------------------------------------
// Work plan.

struct Plan {
  int64_t rows = 0;        // G * T stacked rows per kv head
  int64_t row_block = 0;   // rows per work item
  int64_t row_blocks = 0;
  int64_t rp = 0;          // row pitch of the scratch buffers: row_block rounded up to kRowAlign
  int64_t key_block = 0;   // keys per block (even)
  int64_t splits = 1;      // key-range splits per (b, h, row block)
  int64_t items = 0;
};

constexpr int64_t kMaxRowBlock = 256;

Plan make_plan(const Problem& p, int64_t max_keys) {
  Plan plan;
  plan.rows = p.G * p.T;
  plan.row_blocks = (plan.rows + kMaxRowBlock - 1) / kMaxRowBlock;
  plan.row_block = (plan.rows + plan.row_blocks - 1) / plan.row_blocks;
  plan.rp = (plan.row_block + kRowAlign - 1) / kRowAlign * kRowAlign;
  // A K/V block of 128 KiB in float32 stays in L2 next to Q^T, S^T and O.
  plan.key_block = 32768 / p.D / 2 * 2;
  const int64_t tiles = p.B * p.Hkv * plan.row_blocks;
  const int64_t threads = at::get_num_threads();
  const int64_t key_blocks = std::max<int64_t>(1, (max_keys + plan.key_block - 1) / plan.key_block);
  // Enough items that static scheduling balances: split keys only when the natural
  // items are few compared to the threads.
  if (tiles < 4 * threads && tiles % threads != 0)
    plan.splits = std::min(key_blocks, (4 * threads + tiles - 1) / tiles);
  plan.items = tiles * plan.splits;
  return plan;
}

// Softmax state of one work item: unnormalised O (rp x D), running max m and sum l.
struct State {
  float* o;
  float* m;
  float* l;
  static int64_t floats(const Plan& plan, int64_t D) { return plan.rp * D + 2 * plan.rp; }
  static State at(float* base, const Plan& plan, int64_t D) {
    return {base, base + plan.rp * D, base + plan.rp * D + plan.rp};
  }
};

// Per-thread scratch, carved from one allocation.
struct Scratch {
  float* qt;        // Q^T (float path) or packed Q pairs (bf16 path): D x rp floats
  float* st;        // S^T, then P^T on the float path: key_block x rp
  float* kv;        // float path: a widened K or V block
  uint16_t* vp;     // bf16 path, in kv's space: V pairs vp[j/2][d][2] ...
  uint16_t* pp;     // ... and P pairs pp[j/2][r][2]
  float* alpha;     // rp: rescale factors of one block
  int64_t* mrow;    // rp: mask element offset of each row's (b, query head, tree row)
  float* own;       // a State for unsplit items
  // Only touched for blocks with a non-finite V row in the window; last, so the hot
  // regions above keep their relative placement.
  void* clean_v;    // key_block x D elements: a V block with its non-finite window rows zeroed
  bool* bad_value;  // key_block: which window keys of a block have a non-finite V row
  static int64_t floats(const Plan& plan, int64_t D) {
    return D * plan.rp + plan.key_block * plan.rp + plan.key_block * D + plan.key_block * plan.rp / 2 + plan.rp +
           2 * plan.rp /* mrow, int64 */ + State::floats(plan, D) + plan.key_block * D /* clean_v, at most float */ +
           (plan.key_block + 3) / 4 /* bad_value */;
  }
  static Scratch carve(float* base, const Plan& plan, int64_t D) {
    Scratch s;
    s.qt = base;
    s.st = s.qt + D * plan.rp;
    s.kv = s.st + plan.key_block * plan.rp;
    s.vp = reinterpret_cast<uint16_t*>(s.kv);
    s.pp = s.vp + plan.key_block * D;
    s.alpha = s.kv + plan.key_block * D + plan.key_block * plan.rp / 2;
    s.mrow = reinterpret_cast<int64_t*>(s.alpha + plan.rp);
    s.own = reinterpret_cast<float*>(s.mrow + plan.rp);
    float* clean_v = s.own + State::floats(plan, D);
    s.clean_v = clean_v;
    s.bad_value = reinterpret_cast<bool*>(clean_v + plan.key_block * D);
    return s;
  }
};

// Each thread keeps its scratch between calls: a fresh megabyte per call would cost an
// allocation and its page faults every time. 64-byte aligned, so rows of rp floats start
// on cache lines.
float* thread_scratch(int64_t floats) {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<float, Free> buffer;
  thread_local int64_t capacity = 0;
  if (capacity < floats) {
    const size_t bytes = (size_t(floats) * sizeof(float) + 63) / 64 * 64;
    buffer.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buffer, "tree_attn CPU kernel: out of memory for ", bytes, " bytes of scratch");
    capacity = floats;
  }
  return buffer.get();
}

// scalar_t: the K/V dtype; query_t: the query's and output's (scalar_t, or float over
// half/bfloat16 K/V).
template <typename scalar_t, typename query_t>
struct Kernel {
  const Prepared& in;
  const Problem& p;
  const Plan& plan;
  const int32_t* offsets;  // null: all zero
  const float* sinks;      // [Hq] float32; null: none

  // bfloat16 takes the dot-product path when the CPU has it. A float32 query over
  // bfloat16 K/V stays on the float path: rounding the query to bfloat16 would lose the
  // precision the caller kept.
  static constexpr bool kBf16Dot = TREE_ATTN_BF16_DOT && std::is_same_v<scalar_t, at::BFloat16> &&
                                   std::is_same_v<query_t, at::BFloat16>;

  int64_t offset(int64_t b) const { return offsets ? offsets[b] : 0; }
  int64_t head_of(int64_t h, int64_t row) const { return h * p.G + row / p.T; }

  const query_t* query_row(int64_t b, int64_t h, int64_t row) const {
    return in.query.data_ptr<query_t>() + b * p.q_stride[0] + head_of(h, row) * p.q_stride[1] +
           (row % p.T) * p.q_stride[2];
  }

  // Q^T * scale for rows [r0, r0 + nr) (bf16 path: unscaled bf16 pairs), zero padding.
  void load_query(int64_t b, int64_t h, int64_t r0, int64_t nr, float* qt) const {
    const int64_t rp = plan.rp;
    if constexpr (kBf16Dot) {
      // A pair of adjacent head dims is one 32-bit word: transpose words.
      auto* words = reinterpret_cast<uint32_t*>(qt);
      std::fill(words, words + p.D / 2 * rp, 0u);
      for (int64_t r = 0; r < nr; ++r) {
        const query_t* src = query_row(b, h, r0 + r);
        for (int64_t d2 = 0; d2 < p.D / 2; ++d2) std::memcpy(&words[d2 * rp + r], src + 2 * d2, 4);
      }
    } else {
      std::fill(qt, qt + p.D * rp, 0.0f);
      for (int64_t r = 0; r < nr; ++r) {
        const query_t* src = query_row(b, h, r0 + r);
        for (int64_t d = 0; d < p.D; ++d) qt[d * rp + r] = float(src[d]) * p.scale;
      }
    }
  }

  const scalar_t* cache_rows(const at::Tensor& t, const int64_t* stride, int64_t b, int64_t h, int64_t j0) const {
    return t.data_ptr<scalar_t>() + b * stride[0] + h * stride[1] + j0 * stride[2];
  }

  // nj cache rows as float32 with a row stride: the cache itself for float32, else
  // widened into `scratch`.
  const float* rows_as_float(const scalar_t* rows, int64_t stride, int64_t nj, float* scratch,
                             int64_t* row_stride) const {
    if constexpr (std::is_same_v<scalar_t, float>) {
      *row_stride = stride;
      return rows;
    } else {
      for (int64_t j = 0; j < nj; ++j)
        for (int64_t d = 0; d < p.D; ++d) scratch[j * p.D + d] = float(rows[j * stride + d]);
      *row_stride = p.D;
      return scratch;
    }
  }

  // Mask element offsets of the (b, query head, tree row) of rows [r0, r0 + nr).
  void mask_rows(int64_t b, int64_t h, int64_t r0, int64_t nr, int64_t* mrow) const {
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t row = r0 + r;
      mrow[r] = b * p.mask_stride[0] + head_of(h, row) * p.mask_stride[1] + (row % p.T) * p.mask_stride[2];
    }
  }

  template <typename Fn>
  void for_each_mask_value(Fn&& fn) const {
    if (p.mask_kind == MaskKind::Bool) fn(in.mask.data_ptr<bool>());
    else fn(in.mask.data_ptr<float>());
  }

  static float bias_of(bool visible) { return visible ? 0.0f : -kInf; }
  static float bias_of(float bias) { return bias; }

  bool any_visible(const int64_t* mrow, int64_t nr, int64_t c0, int64_t c1) const {
    bool found = false;
    for_each_mask_value([&](const auto* mask) {
      for (int64_t r = 0; r < nr && !found; ++r)
        for (int64_t c = c0; c < c1 && !found; ++c) found = bias_of(mask[mrow[r] + c * p.mask_stride[3]]) != -kInf;
    });
    return found;
  }

  // s -> softcap(s * scale) in place, for every row of nj keys (before the mask's bias, as
  // the contract orders it). A score that is not finite before the cap (NaN, +-inf, or a
  // float32 overflow) becomes NaN: the cap cannot hide it, and -inf cannot pass for masked.
  void finish_scores(float* st, int64_t nj, float scale) const {
    // A subnormal cap has no float32 inverse; FLT_MAX saturates tanh just the same and
    // keeps 0 * inverse = 0.
    const float cap = p.softcap, inv_cap = std::min(1.0f / p.softcap, std::numeric_limits<float>::max());
    for (int64_t i = 0; i < nj * plan.rp; i += kLanes) {
      Vec s = load(st + i) * scale;
      // Comparisons, not s - s == 0: that is contraction-proof (an FMA of the scaling
      // would leave the product's rounding error).
      const IVec finite = (s < kInf) & (s > -kInf);
      if (p.softcap > 0) s = cap * vtanh(s * inv_cap);
      store(st + i, finite ? s : splat(kNaN));
    }
  }

  // bad[c] = whether the V row of key first + c is not finite, for the block's window keys
  // [first, nj); returns whether any is.
  bool flag_bad_values(const scalar_t* v, int64_t v_stride, int64_t first, int64_t nj, bool* bad) const {
    bool any = false;
    for (int64_t j = first; j < nj; ++j) {
      bad[j - first] = !all_finite(v + j * v_stride, p.D);
      any |= bad[j - first];
    }
    return any;
  }

  // The block's nj V rows copied to `out` (row stride D) with the rows of its bad window
  // keys zeroed: P V then adds P * 0 for them, not 0 * NaN, in the rows that do not see
  // them (the rows that do see them are poisoned by apply_window).
  const scalar_t* without_bad_values(const scalar_t* v, int64_t v_stride, int64_t first, int64_t nj,
                                     const bool* bad, scalar_t* out) const {
    for (int64_t j = 0; j < nj; ++j) {
      scalar_t* dst = out + j * p.D;
      if (j >= first && bad[j - first]) std::fill(dst, dst + p.D, scalar_t(0.0f));
      else std::memcpy(dst, v + j * v_stride, p.D * sizeof(scalar_t));
    }
    return out;
  }

  // The mask over window columns [c0, c1) (st at column c0's scores, finished). What a row
  // does not see becomes -inf by selection, whatever its score holds (adding a -inf bias
  // to a NaN score would give NaN); what it sees gets its bias added, and NaN when the
  // key's V row is not finite (bad[c - c0]), which poisons the row.
  void apply_window(const int64_t* mrow, int64_t nr, int64_t c0, int64_t c1, const bool* bad, float* st) const {
    for_each_mask_value([&](const auto* mask) {
      for (int64_t c = c0; c < c1; ++c) {
        float* row = st + (c - c0) * plan.rp;
        const int64_t col = c * p.mask_stride[3];
        const float poison = bad[c - c0] ? kNaN : 0.0f;
        for (int64_t r = 0; r < nr; ++r) {
          const float bias = bias_of(mask[mrow[r] + col]);
          row[r] = bias == -kInf ? -kInf : row[r] + bias + poison;
        }
      }
    });
  }

  // Online-softmax update with the block's scores (times `scale`): m and l advance,
  // alpha gets each row's rescale factor for O, and the probabilities P go to P^T in
  // place (float path) or, rounded to bf16, to the pairs pp[j/2][r][2] (bf16 path).
  // A NaN score makes l NaN (vexp keeps NaN), and so does +inf (m = +inf, then
  // exp(inf - inf)); l = NaN marks a poisoned row and stays so. `raw` scores come straight
  // from Q K^T, in a prefix block without softcap that every row sees whole: there -inf is
  // a non-finite raw score too, which exp would drop, so it poisons the row here.
  void softmax_update(float* st, int64_t nj, float scale, bool raw, float* m, float* l, float* alpha,
                      uint16_t* pp) const {
    const int64_t rp = plan.rp;
    for (int64_t r = 0; r < rp; r += kLanes) {
      // s -> s * scale is monotonic, so the scaled extremes are the extremes scaled.
      Vec hi = splat(-kInf), lo = splat(kInf);
      for (int64_t j = 0; j < nj; ++j) {
        const Vec x = load(st + j * rp + r);
        hi = vmax(hi, x);
        lo = vmin(lo, x);
      }
      const Vec block_max = vmax(hi * scale, lo * scale);
      if (raw) store(l + r, vmin(hi * scale, lo * scale) == -kInf ? splat(kNaN) : load(l + r));
      const Vec m_old = load(m + r);
      const Vec m_new = vmax(m_old, block_max);
      // A row that has seen no key yet keeps m = -inf; subtract 0 instead so every
      // exponent is exp(-inf) = 0 rather than NaN.
      const Vec m_ref = m_new == -kInf ? splat(0.0f) : m_new;
      Vec sum = splat(0.0f);
      // Keys in pairs; an odd count gets a zero partner (S^T has key_block rows, an even
      // number, so row nj exists whenever nj is odd).
      for (int64_t j = 0; j < nj; j += 2) {
        const Vec e0 = vexp(load(st + j * rp + r) * scale - m_ref);
        const Vec e1 = j + 1 < nj ? vexp(load(st + (j + 1) * rp + r) * scale - m_ref) : splat(0.0f);
        sum += e0 + e1;
#if TREE_ATTN_BF16_DOT
        if constexpr (kBf16Dot) {
          _mm512_storeu_si512(pp + 2 * ((j / 2) * rp + r), interleave_bf16(bit_cast<__m512>(e0), bit_cast<__m512>(e1)));
          continue;
        }
#endif
        store(st + j * rp + r, e0);
        store(st + (j + 1) * rp + r, e1);
      }
      const Vec a = vexp(m_old - m_ref);
      store(l + r, load(l + r) * a + sum);
      store(m + r, m_new);
      store(alpha + r, a);
    }
  }

  void rescale(float* o, const float* alpha, int64_t nr) const {
    for (int64_t r = 0; r < nr; ++r) {
      if (alpha[r] == 1.0f) continue;
      const Vec a = splat(alpha[r]);
      for (int64_t d = 0; d < p.D; d += kLanes) store(o + r * p.D + d, load(o + r * p.D + d) * a);
    }
  }

  void prefetch_rows(const scalar_t* rows, int64_t stride, int64_t n) const {
    constexpr int64_t kLine = 64;
    const auto* bytes = reinterpret_cast<const char*>(rows);
    const int64_t row_bytes = p.D * int64_t(sizeof(scalar_t));
    for (int64_t j = 0; j < n; ++j)
      for (int64_t c = 0; c < row_bytes; c += kLine)
        __builtin_prefetch(bytes + j * stride * int64_t(sizeof(scalar_t)) + c, /*rw=*/0, /*locality=*/2);
  }

  // S^T of the block's nj keys (starting at cache row k) into s.st.
  void scores(const scalar_t* k, int64_t nj, const Scratch& s) const {
#if TREE_ATTN_BF16_DOT
    if constexpr (kBf16Dot) {
      return block_scores_bf16(reinterpret_cast<const uint16_t*>(k), p.k_stride[2], nj,
                               reinterpret_cast<const uint16_t*>(s.qt), plan.rp, p.D, s.st);
    }
#endif
    int64_t k_stride = 0;
    const float* kf = rows_as_float(k, p.k_stride[2], nj, s.kv, &k_stride);
    block_scores(kf, k_stride, nj, s.qt, plan.rp, p.D, s.st);
  }

  // O += P V for the block's nj keys (P from softmax_update, V rows at v, v_stride apart).
  void accumulate_values(const scalar_t* v, int64_t v_stride, int64_t nj, int64_t nr, const Scratch& s,
                        float* o) const {
#if TREE_ATTN_BF16_DOT
    if constexpr (kBf16Dot) {
      pack_values(reinterpret_cast<const uint16_t*>(v), v_stride, nj, p.D, s.vp);
      return block_values_bf16(s.pp, plan.rp, s.vp, (nj + 1) / 2, p.D, o);
    }
#endif
    int64_t vf_stride = 0;
    const float* vf = rows_as_float(v, v_stride, nj, s.kv, &vf_stride);
    block_values(s.st, plan.rp, nr, vf, vf_stride, nj, p.D, o);
  }

  // One work item: rows [r0, r0 + nr) of (b, h) over key blocks [kb0, kb1).
  void run_item(int64_t b, int64_t h, int64_t r0, int64_t nr, int64_t kb0, int64_t kb1, const Scratch& s,
                const State& state) const {
    const int64_t rp = plan.rp, D = p.D;
    const int64_t off = offset(b), end = off + p.M;
    std::fill(state.o, state.o + rp * D, 0.0f);
    std::fill(state.m, state.m + rp, -kInf);
    std::fill(state.l, state.l + rp, 0.0f);
    load_query(b, h, r0, nr, s.qt);
    mask_rows(b, h, r0, nr, s.mrow);
    // float path: the scale is folded into Q; bf16 path: applied to the scores.
    const float score_scale = kBf16Dot ? p.scale : 1.0f;
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      const int64_t j0 = kb * plan.key_block, j1 = std::min(end, j0 + plan.key_block);
      if (j0 >= j1) break;
      const int64_t nj = j1 - j0;
      // Window columns of this block; prefix keys are always visible, so only a block
      // lying entirely inside the window can be skipped.
      const int64_t w0 = std::max(j0, off);
      const bool in_window = w0 < j1;
      if (in_window && j0 >= off && !any_visible(s.mrow, nr, w0 - off, j1 - off)) continue;

      const scalar_t* k = cache_rows(in.key, p.k_stride, b, h, j0);
      const scalar_t* v = cache_rows(in.value, p.v_stride, b, h, j0);
      int64_t v_stride = p.v_stride[2];
      if (kb + 1 < kb1) {
        // Start pulling the next block's K and V towards L2 while this one computes.
        const int64_t next = std::min(end, j1 + plan.key_block) - j1;
        prefetch_rows(cache_rows(in.key, p.k_stride, b, h, j1), p.k_stride[2], next);
        prefetch_rows(cache_rows(in.value, p.v_stride, b, h, j1), p.v_stride[2], next);
      }
      scores(k, nj, s);
      // Prefix blocks without softcap (the hot path) go to the softmax raw.
      const bool raw = p.softcap == 0 && !in_window;
      if (!raw) finish_scores(s.st, nj, score_scale);
      if (in_window) {
        const int64_t first = w0 - j0;  // the block's first window key
        if (flag_bad_values(v, v_stride, first, nj, s.bad_value)) {
          v = without_bad_values(v, v_stride, first, nj, s.bad_value, static_cast<scalar_t*>(s.clean_v));
          v_stride = D;
        }
        apply_window(s.mrow, nr, w0 - off, j1 - off, s.bad_value, s.st + first * rp);
      }
      softmax_update(s.st, nj, raw ? score_scale : 1.0f, raw, state.m, state.l, s.alpha, s.pp);
      rescale(state.o, s.alpha, nr);
      accumulate_values(v, v_stride, nj, nr, s, state.o);
    }
  }

  // Normalised output and lse of rows [r0, r0 + nr) from a finished softmax state. A
  // sink joins the denominator here, once per row: lse = log(l e^m + e^sink) and
  // out = O e^(m - lse). A sink of -inf is none; NaN or +inf poisons the row.
  void write_rows(int64_t b, int64_t h, int64_t r0, int64_t nr, const State& state, at::Tensor& out,
                  at::Tensor& lse) const {
    query_t* o = out.data_ptr<query_t>();
    float* ls = lse.data_ptr<float>();
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t head = head_of(h, r0 + r), i = (b * p.Hq + head) * p.T + (r0 + r) % p.T;
      const float* src = state.o + r * p.D;
      const float sink = sinks ? sinks[head] : -kInf;
      // Poisoned: l is NaN (a non-finite score or window value it sees), O is not finite
      // (a non-finite value of a prefix key, carried through P V), or the sink is.
      const bool poisoned = std::isnan(state.l[r]) || !all_finite(src, p.D) || std::isnan(sink) || sink == kInf;
      const bool sees_none = state.l[r] == 0.0f;
      float row_lse = -kInf, weight = 0.0f;  // out = O * weight
      if (poisoned) {
        row_lse = weight = kNaN;
      } else if (sees_none) {
        row_lse = sink;
      } else {
        const float keys_lse = state.m[r] + std::log(state.l[r]);
        row_lse = sink == -kInf ? keys_lse
                                : std::max(keys_lse, sink) + std::log1p(std::exp(-std::abs(keys_lse - sink)));
        weight = sink == -kInf ? 1.0f / state.l[r] : std::exp(state.m[r] - row_lse);
      }
      query_t* dst = o + i * p.D;
      for (int64_t d = 0; d < p.D; ++d) dst[d] = query_t(src[d] * weight);
      ls[i] = row_lse;
    }
  }

  int64_t rows_in(int64_t rb) const { return std::min(plan.row_block, plan.rows - rb * plan.row_block); }

  void run(at::Tensor& out, at::Tensor& lse) const {
    const int64_t D = p.D;
    const int64_t state_floats = State::floats(plan, D);
    // Split items keep their partial state until the merge; unsplit ones use scratch.
    at::Tensor partials;
    if (plan.splits > 1) partials = at::empty({plan.items, state_floats}, at::kFloat);

    // Items are handed out one at a time, not in fixed chunks: cores are often shared
    // with other work, and a static split would wait for the slowest thread.
    std::atomic<int64_t> next_item{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), plan.items);
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      const Scratch s = Scratch::carve(thread_scratch(Scratch::floats(plan, D)), plan, D);
      for (int64_t item = next_item++; item < plan.items; item = next_item++) {
        const int64_t split = item % plan.splits, tile = item / plan.splits;
        const int64_t rb = tile % plan.row_blocks, bh = tile / plan.row_blocks;
        const int64_t b = bh / p.Hkv, h = bh % p.Hkv;
        const int64_t blocks = (offset(b) + p.M + plan.key_block - 1) / plan.key_block;
        const int64_t kb0 = blocks * split / plan.splits, kb1 = blocks * (split + 1) / plan.splits;
        float* base = plan.splits > 1 ? partials.data_ptr<float>() + item * state_floats : s.own;
        const State state = State::at(base, plan, D);
        run_item(b, h, rb * plan.row_block, rows_in(rb), kb0, kb1, s, state);
        if (plan.splits == 1) write_rows(b, h, rb * plan.row_block, rows_in(rb), state, out, lse);
      }
    });
    if (plan.splits > 1) merge(partials, out, lse);
  }

  // Combines the splits of each (b, h, row block): rescale every split's state to the
  // common max, add, normalise.
  void merge(const at::Tensor& partials, at::Tensor& out, at::Tensor& lse) const {
    const int64_t rp = plan.rp, D = p.D;
    const int64_t state_floats = State::floats(plan, D);
    const int64_t tiles = plan.items / plan.splits;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      at::Tensor buffer = at::empty({state_floats}, at::kFloat);
      const State total = State::at(buffer.data_ptr<float>(), plan, D);
      for (int64_t tile = begin; tile < end; ++tile) {
        float* first = partials.data_ptr<float>() + tile * plan.splits * state_floats;
        std::fill(total.m, total.m + rp, -kInf);
        for (int64_t sp = 0; sp < plan.splits; ++sp) {
          const State part = State::at(first + sp * state_floats, plan, D);
          for (int64_t r = 0; r < rp; ++r) total.m[r] = std::max(total.m[r], part.m[r]);
        }
        std::fill(total.o, total.o + rp * D, 0.0f);
        std::fill(total.l, total.l + rp, 0.0f);
        for (int64_t sp = 0; sp < plan.splits; ++sp) {
          const State part = State::at(first + sp * state_floats, plan, D);
          for (int64_t r = 0; r < rp; ++r) {
            // A split that saw no key has l = 0 and m = -inf: weight 0, not NaN. A
            // poisoned split's NaN l makes the total NaN, and a non-finite O stays
            // non-finite whatever its weight (inf * 0 is NaN).
            const float w = part.l[r] == 0.0f ? 0.0f : std::exp(part.m[r] - total.m[r]);
            total.l[r] += part.l[r] * w;
            for (int64_t d = 0; d < D; ++d) total.o[r * D + d] += part.o[r * D + d] * w;
          }
        }
        const int64_t rb = tile % plan.row_blocks, bh = tile / plan.row_blocks;
        write_rows(bh / p.Hkv, bh % p.Hkv, rb * plan.row_block, rows_in(rb), total, out, lse);
      }
    });
  }
};

void forward_cpu_impl(const Prepared& in, at::Tensor& out, at::Tensor& lse) {
  const Problem& p = in.p;
  const int32_t* offsets = p.has_mask_offset ? in.mask_offset.data_ptr<int32_t>() : nullptr;
  int64_t max_keys = p.M;
  if (offsets)
    for (int64_t b = 0; b < p.B; ++b) max_keys = std::max<int64_t>(max_keys, offsets[b] + p.M);
  const Plan plan = make_plan(p, max_keys);
  const float* sinks = p.has_sinks ? in.sinks.data_ptr<float>() : nullptr;
  // prepare() admits exactly these (query, key/value) pairs.
  const bool f32_query = p.q_dtype == at::kFloat;
  switch (p.kv_dtype) {
    case at::kFloat: return Kernel<float, float>{in, p, plan, offsets, sinks}.run(out, lse);
    case at::kHalf:
      if (f32_query) return Kernel<at::Half, float>{in, p, plan, offsets, sinks}.run(out, lse);
      return Kernel<at::Half, at::Half>{in, p, plan, offsets, sinks}.run(out, lse);
    case at::kBFloat16:
      if (f32_query) return Kernel<at::BFloat16, float>{in, p, plan, offsets, sinks}.run(out, lse);
      return Kernel<at::BFloat16, at::BFloat16>{in, p, plan, offsets, sinks}.run(out, lse);
    default: TORCH_CHECK(false, "tree_attn CPU kernel: unexpected dtype ", p.kv_dtype);  // prepare() rejects it
  }
}

// The CPU backend of the one backend interface (csrc/backend.h). Offsets are host memory
// here, so prepare() checks them.
struct CpuBackend {
  static constexpr OffsetCheck kOffsetCheck = OffsetCheck::OnHost;
  static void run(const Prepared& in, at::Tensor& out, at::Tensor& lse) { forward_cpu_impl(in, out, lse); }
};

}  // namespace

TREE_ATTN_REGISTER_BACKEND(tree_attn, CPU, CpuBackend)

}  // namespace tree_attn

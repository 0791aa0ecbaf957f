#include "cuda/triton_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace tree_attn::triton {
namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct TableRow {
  int64_t D;
  bool half;
  TileConfig config;
};

#define half true
#define f32 false
#define TREE_ATTN_TILE(D, kind, bm, bn, warps, stages, wn) {D, kind, {bm, bn, warps, stages, wn}},
#define TREE_ATTN_HOPPER_TILE(D, cw, bn, stages)
constexpr TableRow kTable[] = {
#include "cuda/tile_configs.def"
};
#undef TREE_ATTN_TILE
#undef TREE_ATTN_HOPPER_TILE
#undef half
#undef f32

struct HopperRow {
  int64_t D;
  HopperConfig config;
};
#define TREE_ATTN_TILE(D, kind, bm, bn, warps, stages, wn)
#define TREE_ATTN_HOPPER_TILE(D, cw, bn, stages) {D, {cw, bn, stages}},
constexpr HopperRow kHopperTable[] = {
#include "cuda/tile_configs.def"
};
#undef TREE_ATTN_TILE
#undef TREE_ATTN_HOPPER_TILE

}  // namespace

int next_pow2(int64_t x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

TileConfig table_config(int64_t D, bool half_dot) {
  for (const auto& row : kTable)
    if (row.D == D && row.half == half_dot) return row.config;
  TORCH_CHECK_VALUE(false, "no Triton tile configuration for head dim D=", D, " (", half_dot ? "half" : "float32",
                    " dot)");
}

std::vector<int64_t> hopper_head_dims() {
  std::vector<int64_t> dims;
  for (const auto& row : kHopperTable) dims.push_back(row.D);
  std::sort(dims.begin(), dims.end());
  return dims;
}

int hopper_d_split(int64_t D) { return D > kHopperMaxDOneWarpgroup ? 2 : 1; }

int hopper_block_m(int64_t D, const HopperConfig& c) { return 16 * c.consumer_warps / hopper_d_split(D); }

int hopper_programs_per_sm(int64_t D, const HopperConfig& c) {
  const int64_t shared = 2 * (int64_t(hopper_block_m(D, c)) * D + 2 * int64_t(c.stages) * c.block_n * D);
  const bool fits_twice = 2 * (shared + kSharedReservePerBlock) <= kSharedPerSm;
  return c.consumer_warps == 4 && fits_twice ? 2 : 1;
}

std::optional<HopperConfig> hopper_config(int64_t D) {
  for (const auto& row : kHopperTable)
    if (row.D == D) return row.config;
  return std::nullopt;
}

Plan choose_hopper(int64_t D, int64_t rows_per_head, int64_t batch_heads, int64_t S, int64_t M, int num_sms,
                   std::optional<int> num_splits) {
  const auto c = hopper_config(D);
  TORCH_CHECK_VALUE(c.has_value(), "the Hopper kernel has no tiles for head dim D=", D);
  Plan p;
  p.kernel = MainKernel::Hopper;
  p.block_m = hopper_block_m(D, *c);
  p.block_n = c->block_n;
  p.block_d = int(D);
  p.window_n = 0;
  p.num_warps = c->consumer_warps;
  p.num_stages = c->stages;
  p.row_blocks = cdiv(rows_per_head, p.block_m);
  const int64_t window = std::min(M, S);
  p.window_units = window > 0 ? int(std::ceil(double(cdiv(window, p.block_n)) * kHopperWindowCost)) : 0;
  if (num_splits) {
    TORCH_CHECK_VALUE(*num_splits >= 1, "num_splits must be >= 1, got ", *num_splits);
    p.num_splits = *num_splits;
  } else {
    p.num_splits = choose_splits(cdiv(std::max<int64_t>(S - M, 0), p.block_n), p.window_units,
                                 p.row_blocks * batch_heads, num_sms, hopper_programs_per_sm(D, *c));
  }
  p.skip_unseen = false;
  p.reduce_block_r = reduce_block(p.block_d);
  return p;
}

bool skip_unseen(int64_t T, int64_t M, int block_m, int window_n) { return T > block_m || M >= T + window_n; }

double window_tiles(int64_t M, int block_n, int window_n) {
  if (M <= 0) return 0.0;
  const double sub_tiles = double(cdiv(M, window_n)) + double(block_n / window_n - 1) / 2.0;
  return sub_tiles * window_n / block_n * kWindowCostFactor;
}

int reduce_block(int block_d) { return std::max(1, kReduceElems / block_d); }

int programs_per_sm(int num_warps) {
  return std::max(1, kRegistersPerSm / (num_warps * 32 * kRegistersPerThread));
}

double makespan(int64_t tiles, double window, int64_t programs, int num_sms, int splits, int per_sm) {
  const int64_t waves = cdiv(programs * splits, int64_t(num_sms) * per_sm);
  const double cost = double(waves) * (std::ceil((double(tiles) + window) / splits) + kProgramOverheadTiles);
  return cost + (splits > 1 ? kReduceCostTiles + splits * kReduceCostPerSplit : 0.0);
}

int choose_splits(int64_t tiles, double window, int64_t programs, int num_sms, int per_sm) {
  if (programs >= int64_t(num_sms) * per_sm || tiles == 0) return 1;
  int best = 1;
  double best_cost = makespan(tiles, window, programs, num_sms, 1, per_sm);
  const int64_t last = std::min<int64_t>(kMaxSplits, tiles + 1);
  for (int s = 2; s <= last; ++s) {
    const double cost = makespan(tiles, window, programs, num_sms, s, per_sm);
    if (cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

Plan choose(int64_t D, bool half_dot, int64_t T, int64_t rows_per_head, int64_t batch_heads, int64_t S, int64_t M,
            int num_sms, std::optional<int> num_splits, std::optional<TileConfig> config) {
  TileConfig c = config ? *config : table_config(D, half_dot);
  if (config && c.window_n == 0) c.window_n = std::min(kWindowN, c.block_n);
  TORCH_CHECK_VALUE(c.block_m >= 16 && c.block_n >= 16 && c.num_warps > 0 && c.num_stages > 0 &&
                        (c.block_m & (c.block_m - 1)) == 0 && (c.block_n & (c.block_n - 1)) == 0,
                    "config: BLOCK_M and BLOCK_N must be powers of 2 >= 16, num_warps and num_stages positive; got (",
                    c.block_m, ", ", c.block_n, ", ", c.num_warps, ", ", c.num_stages, ")");
  TORCH_CHECK_VALUE(c.window_n >= 16 && (c.window_n & (c.window_n - 1)) == 0 && c.block_n % c.window_n == 0,
                    "config: the window sub-tile must be a power of 2 >= 16 dividing BLOCK_N=", c.block_n, ", got ",
                    c.window_n);
  Plan p;
  // Don't pad a tiny row count up to a large block (tl.dot needs M >= 16).
  p.block_m = std::max(16, std::min(c.block_m, next_pow2(rows_per_head)));
  p.block_n = c.block_n;
  p.block_d = next_pow2(D);
  p.window_n = c.window_n;
  p.num_warps = c.num_warps;
  p.num_stages = c.num_stages;
  if (!half_dot && p.num_warps == 8 && p.block_m == 64) {
    // Triton 3.6's float32 (3xTF32) dot is wrong at BLOCK_M 64 with 8 warps: measured on an
    // H100 (tests/gpu_config_probe.py), every such tile gave wrong outputs or an illegal
    // shared-memory read at D=64 and 128, where (128, 32, 8, 2), (32, 32, 8, 1) and every
    // 4-warp tile were right. A config asking for it is refused; a larger block clamped
    // down to it keeps 128 rows (padding rows are masked).
    TORCH_CHECK_VALUE(!(config && c.block_m == 64),
                      "config: a float32 dot at BLOCK_M 64 with 8 warps is miscompiled by Triton 3.6 (wrong "
                      "results); use 4 warps or another BLOCK_M; got (", c.block_m, ", ", c.block_n, ", ", c.num_warps,
                      ", ", c.num_stages, ")");
    p.block_m = 128;
  }
  p.row_blocks = cdiv(rows_per_head, p.block_m);
  p.window_units = int(std::ceil(window_tiles(std::min(M, S), p.block_n, p.window_n)));
  if (num_splits) {
    TORCH_CHECK_VALUE(*num_splits >= 1, "num_splits must be >= 1, got ", *num_splits);
    p.num_splits = *num_splits;
  } else {
    p.num_splits = choose_splits(cdiv(std::max<int64_t>(S - M, 0), p.block_n), p.window_units,
                                 p.row_blocks * batch_heads, num_sms, programs_per_sm(p.num_warps));
  }
  p.skip_unseen = skip_unseen(T, M, p.block_m, p.window_n);
  p.reduce_block_r = reduce_block(p.block_d);
  return p;
}

}  // namespace tree_attn::triton

// The launch plan of the CUDA (Triton) kernels: tiles from tile_configs.def, key splits
// from a makespan model. Pure C++ (no CUDA headers): computed once per call by the C++
// launcher, and by the interpreter launcher and the tests through _C.triton_plan.
//
// A main-kernel program owns BLOCK_M rows of one (batch row, kv head) -- the rows of a kv
// head are its G x T (query head, tree node) pairs stacked -- and one key split. The grid
// is (ceil(G*T / BLOCK_M), B * Hkv, num_splits). Each K/V byte is read once per program
// that covers it: ceil(G*T / BLOCK_M) times in all (from L2 after the first).
//
// Key splits (flash decoding), in units of one prefix key tile's work. The window (the
// masked sub-tiles) costs `window` tiles (kWindowCostFactor per key of a prefix key: the
// H200 ran a 64-key window in about the time of 12 prefix tiles); the splits share prefix
// and window in equal work, the last split taking the window:
//   waves(s) * (ceil((tiles + window) / s) + kProgramOverheadTiles)
//     + [s > 1] * (kReduceCostTiles + s * kReduceCostPerSplit)
// with waves(s) = ceil(programs * s / (SMs * programs per SM)); the smallest s reaching
// the minimum wins. The per-split term is each split's partials written and read back
// (without it the model chose 33 splits at P=65536 on the H200, 8 measured best). Splits
// only when the rows alone leave SMs idle; at most kMaxSplits. Offsets are never read on
// the host, so the model assumes a full cache: a prefix of S - M keys.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace tree_attn::triton {

struct TileConfig {
  int block_m = 0, block_n = 0, num_warps = 0, num_stages = 0, window_n = 0;
};

// Which main kernel a plan launches: the portable Triton kernel, or the Hopper (sm_90)
// Gluon kernel (TMA producer warp, wgmma consumer warpgroups).
enum class MainKernel : int { Triton = 0, Hopper = 1 };

struct Plan {
  MainKernel kernel = MainKernel::Triton;
  int block_m = 0;       // rows per program (a power of 2 >= 16)
  int block_n = 0;       // keys per prefix tile
  int block_d = 0;       // head dims per tile: next power of 2 of D
  int window_n = 0;      // keys per window sub-tile (divides block_n); 0 for Hopper
  int num_warps = 0;     // Hopper: the consumer warps (the producer's warpgroup comes on top)
  int num_stages = 0;    // Hopper: K/V ring slots
  int64_t row_blocks = 0;  // programs along a kv head's rows: ceil(G*T / block_m)
  int num_splits = 1;      // programs along the keys; 1 = no reduce kernel
  int window_units = 0;    // the window's share of the split work, in prefix tiles
  bool skip_unseen = false;  // the window loop tests each sub-tile for a row that sees it
  int reduce_block_r = 0;  // rows per reduce program
  int64_t kv_reads() const { return row_blocks; }
};

// Model constants (see above). Programs resident per SM: the kernels use all 255
// registers a thread may have (ptxas, sm_90a), so registers decide.
inline constexpr int kRegistersPerSm = 65536;
inline constexpr int kRegistersPerThread = 255;
inline constexpr int kWindowN = 16;
inline constexpr double kProgramOverheadTiles = 2.0;
inline constexpr double kReduceCostTiles = 4.0;
inline constexpr double kReduceCostPerSplit = 1.0;
inline constexpr double kWindowCostFactor = 8.0;
inline constexpr int kMaxSplits = 64;
// The reduce kernel: kReduceElems partial elements per split per program (4 warps, 4 per
// thread), kReduceChunk splits' loads issued together (an unrolled loop).
inline constexpr int kReduceElems = 512;
inline constexpr int kReduceChunk = 8;
inline constexpr int kReduceWarps = 4;

// The table row for (D, dot kind); throws c10::ValueError for a D the table lacks.
TileConfig table_config(int64_t D, bool half_dot);

// The plan of one call. rows_per_head = G*T, batch_heads = B*Hkv, S the key capacity, M
// the window (mask columns). `num_splits` / `config` override the model / the table
// (tests, tuning); a bad override throws c10::ValueError.
Plan choose(int64_t D, bool half_dot, int64_t T, int64_t rows_per_head, int64_t batch_heads, int64_t S, int64_t M,
            int num_sms, std::optional<int> num_splits = std::nullopt,
            std::optional<TileConfig> config = std::nullopt);

// Whether whole window sub-tiles can go unseen by a block (the skip test costs the window
// loop its software pipelining): in a tree in topological order a node sees only keys up
// to its own, so only when a block holds part of a tree (T > block_m) or the window is
// wider than the tree.
bool skip_unseen(int64_t T, int64_t M, int block_m, int window_n);

// The Hopper kernel's table row for D (tile_configs.def), or nullopt for a D it lacks.
struct HopperConfig {
  int consumer_warps = 0, block_n = 0, stages = 0;
};
std::optional<HopperConfig> hopper_config(int64_t D);
// The head dims the Hopper table has, ascending (for messages).
std::vector<int64_t> hopper_head_dims();
// Programs of the Hopper kernel one SM holds: two when it has four consumer warps (eight with
// the producer's warpgroup: half the SM's registers) and its shared memory (Q, then STAGES K
// and V tiles, 16-bit) fits twice beside the per-block reserve; else one. The kernel's
// register cap follows from it (hopper_kernels.maxnreg_for; hopper_kernels.programs_per_sm
// mirrors this for the build, a test holds the two equal).
int hopper_programs_per_sm(int64_t D, const HopperConfig& c);
// Above this head dim one warpgroup's registers cannot hold a 64-row float32 accumulator
// (64 x 512 floats = 256 a thread): two consumer warpgroups share each 64-row slice, each
// owning half of the output's and of the scores' columns (hopper_kernels.d_split).
inline constexpr int64_t kHopperMaxDOneWarpgroup = 256;
// Warpgroups that split D for head dim D (1 or 2), and the block's rows: 16 per consumer
// warp over them (hopper_kernels.block_m_for).
int hopper_d_split(int64_t D);
int hopper_block_m(int64_t D, const HopperConfig& c);
inline constexpr int64_t kSharedPerSm = 233472;     // 228 KiB (sm_90)
inline constexpr int64_t kSharedReservePerBlock = 1024;
// A window tile of the Hopper kernel costs this many prefix tiles in the split balance (its
// mask loads, selections and V fix-up); the kernel takes window_units in these units.
inline constexpr double kHopperWindowCost = 2.0;

// The Hopper kernel's plan of one call (same grid and split semantics as the Triton
// kernel's, in its own tiles); the table row must exist (hopper_config).
Plan choose_hopper(int64_t D, int64_t rows_per_head, int64_t batch_heads, int64_t S, int64_t M, int num_sms,
                   std::optional<int> num_splits = std::nullopt);

double window_tiles(int64_t M, int block_n, int window_n);
int reduce_block(int block_d);
int programs_per_sm(int num_warps);
double makespan(int64_t tiles, double window, int64_t programs, int num_sms, int splits, int per_sm = 1);
int choose_splits(int64_t tiles, double window, int64_t programs, int num_sms, int per_sm = 1);
int next_pow2(int64_t x);

}  // namespace tree_attn::triton

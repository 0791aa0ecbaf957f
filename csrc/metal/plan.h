// The launch plan of the Metal tree-attention kernels, in portable C++.
//
// From a validated call (`Prepared`) it computes every launch: kernel (a name from the
// instantiation table shaders/tree_attn_kernels.h, which shaders/tree_attention.metal
// expands), grid, threadgroup size,
// threadgroup memory, buffer bindings with byte offsets, the parameter block and the
// scratch buffer. Both the MPS backend (csrc/metal/*.mm) and the CPU simulator
// (tests/sim/csrc/sim_forward.cpp) encode exactly this plan, so the only code that differs
// between them is the encoding itself.
//
// The model of the device bytes each launch moves lives with the simulator, which checks
// its counts against it (tests/sim/csrc/traffic.h).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "metal/function_constant.h"
#include "tree_attn.h"
#include "tree_attn_params.h"

namespace tree_attn {

// What a buffer argument is bound to.
enum class BufferRole {
  Params,    // setBytes of Plan::params
  Query, Key, Value, Mask,
  MaskOffset,  // int32 [B]; when the call has none, the query buffer is bound and never read
  Sinks,     // float32 [Hq]; when the call has none, the partial-max region is bound and never read
  PartialO, PartialM, PartialL,  // regions of the one float32 scratch buffer
  Output, Lse,
};
const char* role_name(BufferRole role);

struct BufferBinding {
  uint32_t index = 0;  // [[buffer(index)]]
  BufferRole role = BufferRole::Params;
  // Tensors: storage_offset * element_size into the tensor's storage buffer (an MPS
  // tensor's storage is its MTLBuffer). Scratch regions: offset into the scratch buffer.
  // Params: 0.
  uint64_t byte_offset = 0;
  bool writable = false;
};

struct Launch {
  std::string kernel;
  std::array<uint32_t, 3> grid{1, 1, 1};     // threadgroups
  std::array<uint32_t, 3> threads{1, 1, 1};  // threads per threadgroup
  uint32_t threadgroup_memory_bytes = 0;     // at [[threadgroup(0)]]; multiple of 16; 0 = none
  std::vector<BufferBinding> buffers;
  // Function-constant values the kernel's pipeline is specialised with (none: an
  // unspecialised pipeline). kernel + constants identify the pipeline (pipeline_key).
  std::vector<FunctionConstant> constants;
};

// The two main kernels of shaders/tree_attention.metal.
//   Vector (v1, tree_attn_main_*): 32 rows per threadgroup, scalar dot products; every D.
//   Matrix (v2, tree_attn_mma_*): 64 rows per threadgroup, simdgroup-matrix products; every D
//     (at D = 512 16 simdgroups, two per 8 rows, each holding half of the head dims).
// Auto is the plan's choice (choose_family); the others are an internal override for
// tests and benchmarks, not public API.
enum class KernelFamily { Auto, Vector, Matrix };
const char* family_name(KernelFamily family);

// The plan's choice: the matrix kernel wherever it is instantiated (every D of the
// contract) and a kv head has more than 8 rows (G * T > 8); the vector kernel otherwise.
// Each K/V byte is fetched once per row block, ceil(G * T / 64) times per call by the
// matrix kernel against ceil(G * T / 32) by the vector kernel, and its products run on the
// matrix units. At G * T <= 8 both fetch K/V once and the matrix kernel would run one
// 8-row matrix row on 8 row groups, 7 of them idle.
KernelFamily choose_family(const Problem& p);

struct Plan {
  KernelFamily family = KernelFamily::Vector;  // of the main launch (never Auto)
  int32_t block_rows = TREE_ATTN_BLOCK_ROWS;   // rows per main threadgroup: 32 or 64
  TreeAttnParams params{};
  std::vector<Launch> launches;  // in encoding order: main, reduce; empty for an empty problem

  // One float32 scratch buffer: partial outputs [B, Hq, T, n_splits, D], then running
  // maxima and sums [B, Hq, T, n_splits] each; region offsets are 256-byte aligned.
  uint64_t scratch_bytes = 0;
  uint64_t partial_o_offset = 0, partial_m_offset = 0, partial_l_offset = 0;

  // Element sizes the traffic model uses (output: the query's dtype).
  uint32_t q_element_bytes = 0, kv_element_bytes = 0, mask_element_bytes = 0, out_element_bytes = 0;
};

// Keys a main threadgroup aims to split its work into: enough threadgroups to fill a
// large Apple GPU (TARGET_THREADGROUPS), at least MIN_CHUNKS_PER_SPLIT chunks of 32
// keys per split so the split overhead (query loads, partials, reduce) stays small, and
// at most TREE_ATTN_MAX_SPLITS (one reduce lane per split).
constexpr int64_t kTargetThreadgroups = 256;
constexpr int64_t kMinChunksPerSplit = 4;

// Builds the plan. Throws c10::ValueError if a size exceeds what the kernels index with
// 32-bit counters (S, T, Hq, grid dims) or the scratch size overflows.
// `family` other than Auto forces that main kernel (tests and benchmarks); forcing the
// matrix kernel where it has no instantiation throws c10::ValueError.
Plan make_plan(const Prepared& in, KernelFamily family = KernelFamily::Auto);

// Every kernel name a plan can contain, from the instantiation table
// (shaders/tree_attn_kernels.h) the shader is built from.
std::vector<std::string> plan_kernel_names();

// The tensors behind a plan's buffer roles (Params is set as bytes and has none).
struct CallTensors {
  const Prepared& in;
  const at::Tensor& scratch;
  const at::Tensor& output;
  const at::Tensor& lse;
  const at::Tensor& tensor_for(BufferRole role) const;
};

}  // namespace tree_attn

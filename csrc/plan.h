// The launch plan of the Metal tree-attention kernels, in portable C++.
//
// From a validated call (`Prepared`) it computes every launch: kernel (template
// instantiation name in shaders/tree_attention.metal), grid, threadgroup size,
// threadgroup memory, buffer bindings with byte offsets, the parameter block and the
// scratch buffer. Both the MPS backend (csrc/mps/*.mm) and the CPU simulator
// (csrc/sim/sim_dispatch.cpp) encode exactly this plan, so the only code that differs
// between them is the encoding itself.
//
// It also models the device bytes each launch reads (no cache assumed), as a function of
// what each batch row can see. The plan cannot know the offsets (on MPS reading them
// would sync the GPU), so the model takes them as an argument; the simulator checks its
// exact byte counts against it, and `worst_case_visibility` gives the bound without them.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "tree_attn.h"
#include "tree_attn_params.h"

namespace tree_attn {

// What a buffer argument is bound to.
enum class BufferRole {
  Params,    // setBytes of Plan::params
  Query, Key, Value, Mask,
  Offsets,   // int32 [B]; when the call has none, the query buffer is bound and never read
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
};

struct Plan {
  TreeAttnParams params{};
  std::vector<Launch> launches;  // in encoding order: main, reduce; empty for an empty problem

  // One float32 scratch buffer: partial outputs [B, Hq, T, n_splits, D], then running
  // maxima and sums [B, Hq, T, n_splits] each; region offsets are 256-byte aligned.
  uint64_t scratch_bytes = 0;
  uint64_t partial_o_offset = 0, partial_m_offset = 0, partial_l_offset = 0;

  // Element sizes the traffic model uses.
  uint32_t qkv_element_bytes = 0, mask_element_bytes = 0, out_element_bytes = 0;
};

// Keys a main threadgroup aims to split its work into: enough threadgroups to fill a
// large Apple GPU (TARGET_THREADGROUPS), at least MIN_CHUNKS_PER_SPLIT chunks of 32
// keys per split so the split overhead (query loads, partials, reduce) stays small, and
// at most TREE_ATTN_MAX_SPLITS (one reduce lane per split).
constexpr int64_t kTargetThreadgroups = 256;
constexpr int64_t kMinChunksPerSplit = 4;

// Builds the plan. Throws c10::ValueError if a size exceeds what the kernels index with
// 32-bit counters (S, T, Hq, grid dims) or the scratch size overflows.
Plan make_plan(const Prepared& in);

// What batch row b sees, after the kernel's clamping of its offset: every key in
// [0, visible_end) is a candidate (the prefix [0, offset) always attended, the window
// [offset, visible_end) per the mask); nothing at or beyond visible_end is read.
struct Visibility {
  int64_t offset = 0;
  int64_t visible_end = 0;
};
// Applies the kernel's clamping to raw per-batch offsets (empty vector: no offsets).
std::vector<Visibility> visibility_from_offsets(const Problem& p, const std::vector<int64_t>& offsets);
// The most any call of this shape can see: every batch row sees all S keys and a full
// window of M keys.
std::vector<Visibility> worst_case_visibility(const Problem& p);

struct ModelledBytes {
  uint64_t query = 0, key_value = 0, mask = 0, offsets = 0, partials = 0;
  uint64_t total() const { return query + key_value + mask + offsets + partials; }
};

// Device bytes the main launch reads. `skipped_keys` counts (threadgroup, key) pairs of
// window chunks whose mask hides them from every row of the threadgroup's block: their
// K and V are never fetched (count them with `count_skipped_keys` when the mask is
// known; 0 gives the bound for a mask that hides nothing).
ModelledBytes modelled_main_reads(const Plan& plan, const std::vector<Visibility>& vis,
                                  uint64_t skipped_keys = 0);
ModelledBytes modelled_reduce_reads(const Plan& plan);
uint64_t modelled_main_writes(const Plan& plan);
uint64_t modelled_reduce_writes(const Plan& plan);

// The least any kernel must read: K and V of the visible keys, once per batch row and
// kv head.
uint64_t minimum_key_value_bytes(const Plan& plan, const std::vector<Visibility>& vis);

// Mirrors the kernel's chunk-skip decision on the host, for a CPU mask: the number of
// (main threadgroup, key) pairs whose K/V the kernel does not fetch.
uint64_t count_skipped_keys(const Prepared& in, const Plan& plan, const std::vector<Visibility>& vis);

// The plan and its traffic model as JSON (for tests and reports). `vis` may be empty, in
// which case only the worst case is reported.
std::string plan_to_json(const Prepared& in, const Plan& plan, const std::vector<Visibility>& vis);

}  // namespace tree_attn

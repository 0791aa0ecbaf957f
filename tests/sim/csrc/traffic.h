// The traffic model of the Metal launch plan: the device bytes each launch of a plan
// (csrc/metal/plan.h) reads and writes, with no cache assumed, as a function of what each
// batch row can see. The plan cannot know the offsets (on MPS reading them would sync the
// GPU), so the model takes them as an argument. The simulator counts every device byte a
// launch moves and checks the counts against this model exactly; `worst_case_visibility`
// gives the bound for a call whose offsets are unknown.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "metal/plan.h"

namespace tree_attn {

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
  uint64_t query = 0, key_value = 0, mask = 0, offsets = 0, partials = 0, sinks = 0;
  uint64_t total() const { return query + key_value + mask + offsets + partials + sinks; }
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
// (main threadgroup, key) pairs whose K/V the kernel does not fetch, and of (main
// threadgroup, chunk) pairs it skips.
uint64_t count_skipped_keys(const Prepared& in, const Plan& plan, const std::vector<Visibility>& vis);
uint64_t count_skipped_chunks(const Prepared& in, const Plan& plan, const std::vector<Visibility>& vis);

// Chunks of 32 keys the main threadgroups visit, (threadgroup, chunk) pairs: each
// threadgroup walks its split's visible keys in chunks (the last may be partial), less the
// skipped ones (count_skipped_chunks; 0 gives the bound).
uint64_t modelled_main_chunks(const Plan& plan, const std::vector<Visibility>& vis, uint64_t skipped_chunks = 0);
// simdgroup_multiply_accumulate calls of the main launch, as the simulator counts them (per
// simdgroup call, tests/sim/csrc/runtime.h). The matrix kernel: per visited chunk, every
// simdgroup of a threadgroup multiplies its 8 rows' query over its share of the head dims
// with the chunk's K^T (D / 8 / parts x 4 products: 8 dims x 8 keys each) and P with V (as
// many), i.e. 2 x (D / 8) x 4 x 8 row groups = 8 D per threadgroup and chunk, whatever the
// head-dim split (tree_attention.metal, tree_attn_mma). A partial chunk or row block
// multiplies zero-filled tiles at full cost. The vector kernel: none.
uint64_t modelled_main_simdgroup_mmas(const Plan& plan, const std::vector<Visibility>& vis,
                                      uint64_t skipped_chunks = 0);

// The plan and its traffic model as JSON (for tests and reports). `vis` may be empty, in
// which case only the worst case is reported.
std::string plan_to_json(const Prepared& in, const Plan& plan, const std::vector<Visibility>& vis);

}  // namespace tree_attn

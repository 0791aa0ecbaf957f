// The Metal Shading Language simulator's executor: runs a kernel translated from shaders/*.metal
// (see msl2cpp.py) over a grid of threadgroups on the CPU, with the GPU's threadgroup and
// simd-group semantics, and reports any fault (out-of-bounds access, divergent synchronisation,
// bad launch) as an exception instead of undefined behaviour.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "metal/function_constant.h"

namespace tree_attn::sim {

using ::tree_attn::FunctionConstant;

struct Binding {  // one [[buffer(i)]]
  // A device buffer: base of the whole allocation (e.g. tensor.storage().data()), its length in
  // bytes, and the byte offset the kernel's pointer starts at (storage_offset * element_size).
  const void* base = nullptr;
  size_t length = 0;
  size_t offset = 0;
  bool writable = true;
  std::vector<uint8_t> bytes;  // non-empty => setBytes-style inline constant data (base ignored)
  std::string name;            // for error messages, e.g. "key"
};

struct LaunchDesc {
  std::string kernel;                        // [[host_name("...")]] of an instantiation, or kernel name
  std::array<uint32_t, 3> grid{1, 1, 1};     // threadgroups per grid
  std::array<uint32_t, 3> threads{1, 1, 1};  // threads per threadgroup
  std::map<int, size_t> threadgroup_memory;  // [[threadgroup(i)]] -> bytes (multiple of 16)
  std::map<int, Binding> buffers;            // [[buffer(i)]] -> binding
  // Function-constant values (MTLFunctionConstantValues). Each must match, by index and
  // type, a [[function_constant]] of the kernel's file; a constant the kernel uses without a
  // value is a fault when it is used.
  std::vector<FunctionConstant> constants;
};

// What a launch did, summed over all its threads. Exact counts, no cache or hardware model.
struct LaunchStats {
  // Device memory (device_ptr accesses, including simdgroup_load/store: 64 elements each);
  // setBytes data and program-scope constants are not device memory.
  uint64_t device_bytes_read = 0, device_bytes_written = 0;
  // Threadgroup memory through scalar elements of 2 bytes or more (`tile[i]`, `*p`, threadgroup
  // scalars) and simdgroup_load/store (64 elements each). Not counted: vector, struct and 1-byte
  // elements, which the prelude hands out as plain references (it cannot tell a read from a
  // write there), like its race detector.
  uint64_t threadgroup_bytes_read = 0, threadgroup_bytes_written = 0;
  // simdgroup_multiply / simdgroup_multiply_accumulate calls, per simdgroup: each is one 8x8x8
  // multiply-accumulate.
  uint64_t simdgroup_mmas = 0;
  // Scalar fused multiply-adds through fma(), per thread (a vecN fma counts N). `a * b + c`
  // written out is not counted: the prelude's float is the C++ float, it sees no such operation.
  uint64_t scalar_fmas = 0;
  // Value-exchanging simd-group functions (simd_shuffle*, simd_broadcast*, simd_sum and the other
  // reductions, prefix scans, simd_any/all/ballot, simd_is_first), per simdgroup op: one call by
  // all lanes of a simdgroup counts 1. simdgroup_barrier and simdgroup_matrix ops are not counted.
  uint64_t shuffles = 0;
};

// The counters under their stable names (the keys of the Python-side dicts and JSON objects:
// tree_attn_sim.launch_counters, tree_attn_sim.traffic). A cost model consumes them: add keys,
// never rename one.
inline std::vector<std::pair<const char*, uint64_t>> counter_items(const LaunchStats& s) {
  return {{"device_bytes_read", s.device_bytes_read},
          {"device_bytes_written", s.device_bytes_written},
          {"threadgroup_bytes_read", s.threadgroup_bytes_read},
          {"threadgroup_bytes_written", s.threadgroup_bytes_written},
          {"simdgroup_mmas", s.simdgroup_mmas},
          {"scalar_fmas", s.scalar_fmas},
          {"shuffles", s.shuffles}};
}

inline constexpr uint32_t kSimdWidth = 32;
inline constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;
inline constexpr size_t kMaxThreadgroupMemory = 32 * 1024;

bool has_kernel(const std::string& name);
std::vector<std::string> kernel_names();
// Runs the kernel to completion. Throws std::runtime_error on any fault, with the kernel name,
// the buffer and index, and the threadgroup and thread that faulted.
LaunchStats launch(const LaunchDesc& desc);

}  // namespace tree_attn::sim

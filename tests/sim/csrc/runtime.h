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
#include <vector>

namespace tree_attn::sim {

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
};

struct LaunchStats {
  uint64_t device_bytes_read = 0, device_bytes_written = 0;
};

inline constexpr uint32_t kSimdWidth = 32;
inline constexpr uint32_t kMaxThreadsPerThreadgroup = 1024;
inline constexpr size_t kMaxThreadgroupMemory = 32 * 1024;

bool has_kernel(const std::string& name);
std::vector<std::string> kernel_names();
// Runs the kernel to completion. Throws std::runtime_error on any fault, with the kernel name,
// the buffer and index, and the threadgroup and thread that faulted.
LaunchStats launch(const LaunchDesc& desc);

}  // namespace tree_attn::sim

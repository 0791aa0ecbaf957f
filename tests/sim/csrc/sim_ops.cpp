// Debug ops that expose the Metal Shading Language simulator directly, for tests of the
// simulator itself (tests/test_simulator.py): `launch` runs any translated kernel on CPU
// tensors bound as writable buffers, which is why this is test apparatus only.
// `launch_counters` runs it the same way and returns every counter of the launch as a dict.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "runtime.h"

namespace tree_attn {
namespace {

std::string dims_str(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::array<uint32_t, 3> launch_dims(c10::IntArrayRef v, const char* what) {
  TORCH_CHECK(!v.empty() && v.size() <= 3, "tree_attn_sim.launch: ", what, " must have 1 to 3 entries, got ",
              dims_str(v));
  std::array<uint32_t, 3> out{1, 1, 1};
  for (size_t i = 0; i < v.size(); ++i) {
    TORCH_CHECK(v[i] >= 0 && v[i] <= UINT32_MAX, "tree_attn_sim.launch: ", what, " ", dims_str(v),
                " has an entry outside [0, 2^32)");
    out[i] = uint32_t(v[i]);
  }
  return out;
}

// buffers[i] is bound at [[buffer(i)]]: the whole storage, offset to the tensor's first element,
// writable. threadgroup_memory[i] is the length of [[threadgroup(i)]].
sim::LaunchStats run_launch(const std::string& kernel, c10::IntArrayRef grid, c10::IntArrayRef threads,
                           c10::IntArrayRef threadgroup_memory, at::TensorList buffers) {
  sim::LaunchDesc desc;
  desc.kernel = kernel;
  desc.grid = launch_dims(grid, "grid");
  desc.threads = launch_dims(threads, "threads");
  for (size_t i = 0; i < threadgroup_memory.size(); ++i) {
    TORCH_CHECK(threadgroup_memory[i] >= 0, "tree_attn_sim.launch: threadgroup_memory[", i, "] = ",
                threadgroup_memory[i], " is negative");
    desc.threadgroup_memory[int(i)] = size_t(threadgroup_memory[i]);
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    const at::Tensor& t = buffers[i];
    TORCH_CHECK(t.device().is_cpu(), "tree_attn_sim.launch: buffers[", i, "] must be a CPU tensor, got ", t.device());
    sim::Binding b;
    b.base = t.storage().data();
    b.length = t.storage().nbytes();
    b.offset = size_t(t.storage_offset()) * t.element_size();
    b.writable = true;
    b.name = "buffers[" + std::to_string(i) + "]";
    desc.buffers[int(i)] = std::move(b);
  }
  return sim::launch(desc);
}

// [device bytes read, device bytes written].
std::vector<int64_t> metal_sim_launch(const std::string& kernel, c10::IntArrayRef grid, c10::IntArrayRef threads,
                                      c10::IntArrayRef threadgroup_memory, at::TensorList buffers) {
  const sim::LaunchStats stats = run_launch(kernel, grid, threads, threadgroup_memory, buffers);
  return {int64_t(stats.device_bytes_read), int64_t(stats.device_bytes_written)};
}

// Every counter of the launch by name (runtime.h counter_items, LaunchStats documents them).
c10::Dict<std::string, int64_t> metal_sim_launch_counters(const std::string& kernel, c10::IntArrayRef grid,
                                                          c10::IntArrayRef threads, c10::IntArrayRef threadgroup_memory,
                                                          at::TensorList buffers) {
  const sim::LaunchStats stats = run_launch(kernel, grid, threads, threadgroup_memory, buffers);
  c10::Dict<std::string, int64_t> out;
  for (const auto& [name, value] : sim::counter_items(stats)) out.insert(name, int64_t(value));
  return out;
}

std::vector<std::string> metal_sim_kernels() { return sim::kernel_names(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tree_attn_sim, m) {
  m.def(
      "launch(str kernel, int[] grid, int[] threads, int[] threadgroup_memory, Tensor(a!)[] buffers) "
      "-> int[]");
  m.def(
      "launch_counters(str kernel, int[] grid, int[] threads, int[] threadgroup_memory, Tensor(a!)[] buffers) "
      "-> Dict(str, int)");
  m.def("kernels() -> str[]", &metal_sim_kernels);
}

TORCH_LIBRARY_IMPL(tree_attn_sim, CPU, m) {
  m.impl("launch", &metal_sim_launch);
  m.impl("launch_counters", &metal_sim_launch_counters);
}

}  // namespace tree_attn

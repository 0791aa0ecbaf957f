// Debug ops that expose the Metal Shading Language simulator directly, for tests of the
// simulator itself (tests/test_simulator.py): `launch` runs any translated kernel on CPU
// tensors bound as writable buffers, which is why this is test apparatus only.
// `launch_counters` runs it the same way and returns every counter of the launch as a dict.
// Both take the pipeline's function-constant values as strings "index:type=value".
#include <ATen/ATen.h>
#include <torch/library.h>

#include <c10/util/Half.h>

#include <cstdlib>
#include <optional>
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
// One function constant written "index:type=value", e.g. "0:uint=128", "3:bool=true",
// "2:float=0.5", "4:half=1.5" (rounded to nearest even). Integers must fit their type.
FunctionConstant parse_constant(const std::string& spec) {
  const auto colon = spec.find(':'), eq = spec.find('=');
  TORCH_CHECK_VALUE(colon != std::string::npos && eq != std::string::npos && colon < eq,
                    "tree_attn_sim.launch: function constant '", spec, "' is not written index:type=value");
  const std::string index_text = spec.substr(0, colon), type = spec.substr(colon + 1, eq - colon - 1),
                    value = spec.substr(eq + 1);
  char* end = nullptr;
  const unsigned long long index = std::strtoull(index_text.c_str(), &end, 10);
  TORCH_CHECK_VALUE(!index_text.empty() && *end == 0 && index <= UINT32_MAX, "tree_attn_sim.launch: function constant '",
                    spec, "': bad index");
  const auto u32 = uint32_t(index);
  auto integer = [&](long long lo, long long hi) {
    char* e = nullptr;
    const long long v = std::strtoll(value.c_str(), &e, 0);
    TORCH_CHECK_VALUE(!value.empty() && *e == 0 && v >= lo && v <= hi, "tree_attn_sim.launch: function constant '",
                      spec, "': value is not a ", type);
    return v;
  };
  if (type == "bool") {
    TORCH_CHECK_VALUE(value == "true" || value == "false" || value == "1" || value == "0",
                      "tree_attn_sim.launch: function constant '", spec, "': a bool is true/false/1/0");
    return FunctionConstant::of_bool(u32, value == "true" || value == "1");
  }
  if (type == "int") return FunctionConstant::of_int(u32, int32_t(integer(INT32_MIN, INT32_MAX)));
  if (type == "uint") return FunctionConstant::of_uint(u32, uint32_t(integer(0, UINT32_MAX)));
  if (type == "short") return FunctionConstant::of_short(u32, int16_t(integer(INT16_MIN, INT16_MAX)));
  if (type == "ushort") return FunctionConstant::of_ushort(u32, uint16_t(integer(0, UINT16_MAX)));
  if (type == "float" || type == "half") {
    char* e = nullptr;
    const double v = std::strtod(value.c_str(), &e);
    TORCH_CHECK_VALUE(!value.empty() && *e == 0, "tree_attn_sim.launch: function constant '", spec,
                      "': value is not a number");
    if (type == "float") return FunctionConstant::of_float(u32, float(v));
    return FunctionConstant::of_half_bits(u32, c10::Half(float(v)).x);
  }
  TORCH_CHECK_VALUE(false, "tree_attn_sim.launch: function constant '", spec,
                    "': type must be bool, int, uint, short, ushort, float or half");
}

sim::LaunchStats run_launch(const std::string& kernel, c10::IntArrayRef grid, c10::IntArrayRef threads,
                           c10::IntArrayRef threadgroup_memory, at::TensorList buffers,
                           const std::optional<std::vector<std::string>>& constants) {
  sim::LaunchDesc desc;
  if (constants)
    for (const std::string& c : *constants) desc.constants.push_back(parse_constant(c));
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
                                      c10::IntArrayRef threadgroup_memory, at::TensorList buffers,
                                      std::optional<std::vector<std::string>> constants) {
  const sim::LaunchStats stats = run_launch(kernel, grid, threads, threadgroup_memory, buffers, constants);
  return {int64_t(stats.device_bytes_read), int64_t(stats.device_bytes_written)};
}

// Every counter of the launch by name (runtime.h counter_items, LaunchStats documents them).
c10::Dict<std::string, int64_t> metal_sim_launch_counters(const std::string& kernel, c10::IntArrayRef grid,
                                                          c10::IntArrayRef threads, c10::IntArrayRef threadgroup_memory,
                                                          at::TensorList buffers,
                                                          std::optional<std::vector<std::string>> constants) {
  const sim::LaunchStats stats = run_launch(kernel, grid, threads, threadgroup_memory, buffers, constants);
  c10::Dict<std::string, int64_t> out;
  for (const auto& [name, value] : sim::counter_items(stats)) out.insert(name, int64_t(value));
  return out;
}

std::vector<std::string> metal_sim_kernels() { return sim::kernel_names(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tree_attn_sim, m) {
  m.def(
      "launch(str kernel, int[] grid, int[] threads, int[] threadgroup_memory, Tensor(a!)[] buffers, "
      "str[]? constants=None) -> int[]");
  m.def(
      "launch_counters(str kernel, int[] grid, int[] threads, int[] threadgroup_memory, Tensor(a!)[] buffers, "
      "str[]? constants=None) -> Dict(str, int)");
  m.def("kernels() -> str[]", &metal_sim_kernels);
}

TORCH_LIBRARY_IMPL(tree_attn_sim, CPU, m) {
  m.impl("launch", &metal_sim_launch);
  m.impl("launch_counters", &metal_sim_launch_counters);
}

}  // namespace tree_attn

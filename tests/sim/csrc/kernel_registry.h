// How a translated kernel is registered with the runtime and how its arguments are produced.
// msl2cpp.py emits, for each kernel (or template instantiation with [[host_name]]), a launcher
// that builds every argument from the running thread's context and calls the kernel, plus a
// table describing its [[buffer]] and [[threadgroup]] parameters so launch() can check the
// bindings before anything runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "exec.h"
#include "msl.h"

namespace tree_attn::sim::detail {

enum class ParamKind : uint8_t { device_pointer, buffer_reference, threadgroup_pointer, attribute };

enum class Attr : uint8_t {
  threadgroup_position_in_grid,
  thread_position_in_threadgroup,
  thread_index_in_threadgroup,
  threads_per_threadgroup,
  threadgroups_per_grid,
  thread_position_in_grid,
  threads_per_grid,
  simdgroup_index_in_threadgroup,
  thread_index_in_simdgroup,
  threads_per_simdgroup,
  simdgroups_per_threadgroup,
};

struct ParamInfo {
  ParamKind kind;
  int index;          // [[buffer(i)]] / [[threadgroup(i)]]; -1 for attributes
  const char* name;   // the parameter's name in the .metal source
  const char* type;   // its MSL type, for messages
  size_t value_size;  // sizeof the referenced struct (buffer_reference) or element
  bool read_only;
};

using LaunchFn = void (*)(ThreadCtx&);

// A `constant T name [[function_constant(index)]];` of the kernel's .metal file.
struct FunctionConstantInfo {
  const char* name;
  uint32_t index;
  ::tree_attn::FunctionConstantType type;
};

struct KernelEntry {
  const char* name;
  LaunchFn launch;
  const ParamInfo* params;
  size_t num_params;
  uint32_t max_total_threads;  // [[max_total_threads_per_threadgroup(N)]], 0 if none
  const char* source;          // the .metal file
  const FunctionConstantInfo* constants;  // the file's function constants (slot = position)
  size_t num_constants;
};

struct KernelRegistrar {
  explicit KernelRegistrar(const KernelEntry& entry);
};

// --- runtime services used by the generated launchers ---
BufferState* bound_buffer(ThreadCtx& t, int index);
TgRegion bound_threadgroup_memory(ThreadCtx& t, int index);
void attribute_value(const ThreadCtx& t, Attr attr, uint32_t out[3]);

template <class T> struct ArgTraits {
  static_assert(sizeof(T) == 0,
                "msl2cpp: unsupported kernel parameter type (expected a device/constant/threadgroup "
                "pointer, a constant reference, or a position attribute)");
};
template <class U> struct ArgTraits<::metal::device_ptr<U>> {
  static constexpr ParamKind kind = ParamKind::device_pointer;
  static constexpr size_t value_size = sizeof(U);
  static constexpr bool read_only = std::is_const_v<U>;
  static ::metal::device_ptr<U> make(ThreadCtx& t, int index) {
    BufferState* b = bound_buffer(t, index);
    return ::metal::device_ptr<U>(b, b->kernel_base);
  }
};
template <class U> struct ArgTraits<const U&> {
  static constexpr ParamKind kind = ParamKind::buffer_reference;
  static constexpr size_t value_size = sizeof(U);
  static constexpr bool read_only = true;
  static const U& make(ThreadCtx& t, int index) {
    return *reinterpret_cast<const U*>(bound_buffer(t, index)->kernel_base);
  }
};
template <class U> struct ArgTraits<::metal::threadgroup_ptr<U>> {
  static constexpr ParamKind kind = ParamKind::threadgroup_pointer;
  static constexpr size_t value_size = sizeof(U);
  static constexpr bool read_only = std::is_const_v<U>;
  static ::metal::threadgroup_ptr<U> make(ThreadCtx& t, int index) {
    const TgRegion r = bound_threadgroup_memory(t, index);
    return ::metal::threadgroup_ptr<U>(r, r.begin);
  }
};

template <class T> T make_attribute(const ThreadCtx& t, Attr attr) {
  uint32_t v[3];
  attribute_value(t, attr, v);
  if constexpr (::metal::is_vec_v<T>) {
    static_assert(T::size <= 3, "position attributes have at most 3 components");
    T r;
    for (int i = 0; i < T::size; ++i) r[i] = typename T::element_type(v[i]);
    return r;
  } else {
    static_assert(std::is_integral_v<T>, "position attributes are integer scalars or vectors");
    return T(v[0]);
  }
}

// `Expected` is what the parameter's attribute asks for ([[buffer(i)]]: a device pointer or a
// constant reference; [[threadgroup(i)]]: a threadgroup pointer).
template <class T, bool Threadgroup>
constexpr ParamInfo resource_param(int index, const char* name, const char* type) {
  static_assert((ArgTraits<T>::kind == ParamKind::threadgroup_pointer) == Threadgroup,
                "msl2cpp: [[buffer(i)]] needs a device/constant pointer or constant reference, "
                "[[threadgroup(i)]] a threadgroup pointer");
  return ParamInfo{ArgTraits<T>::kind, index, name, type, ArgTraits<T>::value_size, ArgTraits<T>::read_only};
}
constexpr ParamInfo attribute_param(const char* name, const char* type) {
  return ParamInfo{ParamKind::attribute, -1, name, type, 0, true};
}

}  // namespace tree_attn::sim::detail

// The compiled CUDA kernels a process can launch: prebuilt cubins (registered at import
// from the package's manifest, loaded at first use) and kernels compiled once at run time
// for a spec the prebuilt table lacks (through a compiler hook the Python side installs).
// Lookups are by KernelSpec; loaded functions are per (spec, device).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/driver.h"

namespace tree_attn::cuda {

// Everything that selects one compiled kernel. Fields and their order are
// torch_tree_attn/backends/cuda/compiler.py's SPEC_FIELDS (a test holds them equal); dtypes are
// its DTYPE_CODES. Fields a kernel kind does not use stay 0.
struct KernelSpec {
  int32_t kind = 0;         // 0 main pass (Triton), 1 reduce pass, 2 main pass (Hopper, Gluon)
  int32_t arch = 0;         // compute capability, major * 10 + minor
  int32_t q_dtype = 0;      // query / output
  int32_t kv_dtype = 0;     // key / value (main)
  int32_t head_dim = 0;
  int32_t block_m = 0, block_n = 0, block_d = 0, window_n = 0;  // main tiles (Hopper: window_n 0)
  int32_t block_r = 0, chunk = 0;                               // reduce tiles
  int32_t num_warps = 0, num_stages = 0;  // Hopper: consumer warps, K/V ring slots
  int32_t mask_float = 0, softcap = 0, skip_unseen = 0;         // main variants
  int32_t aligned = 0;      // pointers and row strides divisible by 16
  int32_t wide = 0;         // sizes and strides int64 (else int32)
};

inline constexpr std::pair<const char*, int32_t KernelSpec::*> kSpecFields[] = {
    {"kind", &KernelSpec::kind},           {"arch", &KernelSpec::arch},
    {"q_dtype", &KernelSpec::q_dtype},     {"kv_dtype", &KernelSpec::kv_dtype},
    {"head_dim", &KernelSpec::head_dim},   {"block_m", &KernelSpec::block_m},
    {"block_n", &KernelSpec::block_n},     {"block_d", &KernelSpec::block_d},
    {"window_n", &KernelSpec::window_n},   {"block_r", &KernelSpec::block_r},
    {"chunk", &KernelSpec::chunk},         {"num_warps", &KernelSpec::num_warps},
    {"num_stages", &KernelSpec::num_stages}, {"mask_float", &KernelSpec::mask_float},
    {"softcap", &KernelSpec::softcap},     {"skip_unseen", &KernelSpec::skip_unseen},
    {"aligned", &KernelSpec::aligned},     {"wide", &KernelSpec::wide},
};
inline constexpr size_t kNumSpecFields = sizeof(kSpecFields) / sizeof(kSpecFields[0]);
using SpecKey = std::array<int32_t, kNumSpecFields>;
SpecKey key_of(const KernelSpec& s);

enum class DtypeCode : int32_t { F32 = 0, F16 = 1, BF16 = 2 };
enum class KernelKind : int32_t { Main = 0, Reduce = 1, HopperMain = 2 };

// How a kernel's tensor-descriptor parameter is encoded (Triton's tensordesc metadata): the
// launcher builds the CUtensorMap of each call with these and the tensor's own shape and
// strides.
struct TmaMeta {
  int data_type = 0;        // CUtensorMapDataType (host enum)
  int elem_size = 0;        // bytes
  int swizzle = 0;          // CUtensorMapSwizzle
  std::vector<uint32_t> block;  // box dims, outermost first (as Triton lists them)
};

// A compiled kernel: its cubin (bytes, or a file read at first load), entry point and
// launch facts as Triton reported them.
struct KernelBinary {
  std::string cubin;        // the image, or empty with `path` set
  std::string path;
  std::string function;
  int shared = 0;           // dynamic shared memory, bytes
  int num_warps = 0;
  int scratch_args = 2;     // Triton's trailing scratch pointers, passed as null
  std::vector<TmaMeta> tma; // one per tensor-descriptor parameter, in order
  bool prebuilt = false;
};

struct LoadedKernel {
  cuda_driver::CUfunction function = nullptr;
  int shared = 0;
  int threads = 0;
  int scratch_args = 2;
  std::vector<TmaMeta> tma;
};

class KernelRegistry {
 public:
  using Compiler = std::function<KernelBinary(const KernelSpec&)>;
  static KernelRegistry& instance();

  void add(const KernelSpec& spec, KernelBinary binary);  // replaces a binary of that spec
  void set_compiler(Compiler compiler);
  // "prebuilt", "compiled" or "missing" (nothing registered yet): no loading, no compiling.
  std::string origin(const KernelSpec& spec) const;
  // The kernel for `spec` on `device`: loaded at first use (compiled first, through the
  // hook, if no binary is registered). Throws c10::Error naming the spec if neither works.
  const LoadedKernel& get(const KernelSpec& spec, int device);

  struct Stats {
    int64_t prebuilt = 0, compiled = 0, loaded = 0;
  };
  Stats stats() const;

 private:
  mutable std::mutex mu_;
  std::map<SpecKey, KernelBinary> binaries_;
  std::map<std::pair<SpecKey, int>, LoadedKernel> loaded_;
  Compiler compiler_;
  int64_t compiled_ = 0;
};

std::string describe(const KernelSpec& spec);

}  // namespace tree_attn::cuda

#include "cuda/kernel_registry.h"

#include <c10/util/Exception.h>

#include <fstream>
#include <sstream>

namespace tree_attn::cuda {

SpecKey key_of(const KernelSpec& s) {
  SpecKey k{};
  for (size_t i = 0; i < kNumSpecFields; ++i) k[i] = s.*(kSpecFields[i].second);
  return k;
}

std::string describe(const KernelSpec& spec) {
  std::ostringstream o;
  o << "{";
  for (size_t i = 0; i < kNumSpecFields; ++i) o << (i ? ", " : "") << kSpecFields[i].first << "=" << spec.*(kSpecFields[i].second);
  o << "}";
  return o.str();
}

KernelRegistry& KernelRegistry::instance() {
  static KernelRegistry* r = new KernelRegistry();  // never destroyed: kernels outlive static teardown
  return *r;
}

void KernelRegistry::add(const KernelSpec& spec, KernelBinary binary) {
  std::lock_guard<std::mutex> lock(mu_);
  binaries_[key_of(spec)] = std::move(binary);
}

void KernelRegistry::set_compiler(Compiler compiler) {
  std::lock_guard<std::mutex> lock(mu_);
  compiler_ = std::move(compiler);
}

std::string KernelRegistry::origin(const KernelSpec& spec) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = binaries_.find(key_of(spec));
  if (it == binaries_.end()) return "missing";
  return it->second.prebuilt ? "prebuilt" : "compiled";
}

KernelRegistry::Stats KernelRegistry::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  Stats s;
  for (const auto& kv : binaries_) s.prebuilt += kv.second.prebuilt ? 1 : 0;
  s.compiled = compiled_;
  s.loaded = int64_t(loaded_.size());
  return s;
}

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f.good(), "tree_attn: cannot read the prebuilt kernel ", path,
              " (reinstall the package, or delete its kernels/manifest.json to compile at run time)");
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

LoadedKernel load(const KernelBinary& b, int device) {
  namespace d = cuda_driver;
  const d::Driver& drv = d::driver();
  d::ensure_context(device);
  const std::string image = b.cubin.empty() ? read_file(b.path) : b.cubin;
  d::CUmodule module = nullptr;
  d::check(drv.cuModuleLoadData(&module, image.data()), "cuModuleLoadData");
  LoadedKernel k;
  d::check(drv.cuModuleGetFunction(&k.function, module, b.function.c_str()), "cuModuleGetFunction");
  // As Triton does: beyond 48 KB, dynamic shared memory must be opted into per function.
  if (b.shared > 49152) {
    const auto& info = d::device_info(device);
    int static_shared = 0;
    d::check(drv.cuFuncGetAttribute(&static_shared, d::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, k.function),
             "cuFuncGetAttribute");
    TORCH_CHECK(b.shared + static_shared <= info.max_shared_optin, "tree_attn: kernel ", b.function, " needs ",
                b.shared + static_shared, " bytes of shared memory, the device allows ", info.max_shared_optin);
    d::check(drv.cuFuncSetCacheConfig(k.function, d::CU_FUNC_CACHE_PREFER_SHARED), "cuFuncSetCacheConfig");
    d::check(drv.cuFuncSetAttribute(k.function, d::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    info.max_shared_optin - static_shared),
             "cuFuncSetAttribute");
  }
  k.shared = b.shared;
  k.threads = 32 * b.num_warps;
  k.scratch_args = b.scratch_args;
  k.tma = b.tma;
  return k;
}

}  // namespace

const LoadedKernel& KernelRegistry::get(const KernelSpec& spec, int device) {
  const SpecKey key = key_of(spec);
  std::unique_lock<std::mutex> lock(mu_);
  auto hit = loaded_.find({key, device});
  if (hit != loaded_.end()) return hit->second;
  auto bin = binaries_.find(key);
  if (bin == binaries_.end()) {
    Compiler compiler = compiler_;
    TORCH_CHECK(compiler, "tree_attn: no prebuilt CUDA kernel for ", describe(spec),
                " and no run-time compiler (install triton to compile it once per process)");
    lock.unlock();  // the compiler may take seconds, and runs Python
    KernelBinary compiled = compiler(spec);
    compiled.prebuilt = false;
    lock.lock();
    bin = binaries_.find(key);
    if (bin == binaries_.end()) {
      bin = binaries_.emplace(key, std::move(compiled)).first;
      ++compiled_;
    }
  }
  LoadedKernel k = load(bin->second, device);
  return loaded_.emplace(std::make_pair(key, device), k).first->second;
}

}  // namespace tree_attn::cuda

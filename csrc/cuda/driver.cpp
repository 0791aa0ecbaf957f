#include "cuda/driver.h"

#include <c10/util/Exception.h>
#include <dlfcn.h>

#include <array>
#include <memory>
#include <mutex>

namespace tree_attn::cuda_driver {
namespace {

template <class F>
void bind(void* lib, F*& slot, const char* name) {
  slot = reinterpret_cast<F*>(dlsym(lib, name));
  TORCH_CHECK(slot != nullptr, "tree_attn: libcuda.so.1 has no ", name);
}

std::unique_ptr<Driver> load() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(lib != nullptr, "tree_attn: cannot load the CUDA driver (libcuda.so.1): ", dlerror());
  auto d = std::make_unique<Driver>();
  bind(lib, d->cuInit, "cuInit");
  bind(lib, d->cuGetErrorString, "cuGetErrorString");
  bind(lib, d->cuDeviceGet, "cuDeviceGet");
  bind(lib, d->cuDeviceGetAttribute, "cuDeviceGetAttribute");
  bind(lib, d->cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  bind(lib, d->cuCtxGetCurrent, "cuCtxGetCurrent");
  bind(lib, d->cuCtxSetCurrent, "cuCtxSetCurrent");
  bind(lib, d->cuModuleLoadData, "cuModuleLoadData");
  bind(lib, d->cuModuleGetFunction, "cuModuleGetFunction");
  bind(lib, d->cuFuncGetAttribute, "cuFuncGetAttribute");
  bind(lib, d->cuFuncSetAttribute, "cuFuncSetAttribute");
  bind(lib, d->cuFuncSetCacheConfig, "cuFuncSetCacheConfig");
  bind(lib, d->cuLaunchKernel, "cuLaunchKernel");
  d->cuTensorMapEncodeTiled =
      reinterpret_cast<decltype(d->cuTensorMapEncodeTiled)>(dlsym(lib, "cuTensorMapEncodeTiled"));
  {
    const CUresult r = d->cuInit(0);
    TORCH_CHECK(r == CUDA_SUCCESS, "tree_attn: cuInit failed with CUDA driver error ", r);
  }
  return d;
}

constexpr int kMaxDevices = 64;

}  // namespace

const Driver& driver() {
  static const std::unique_ptr<Driver> d = load();
  return *d;
}

void check(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* msg = nullptr;
  if (driver().cuGetErrorString(r, &msg) != CUDA_SUCCESS || msg == nullptr) msg = "unknown error";
  TORCH_CHECK(false, "tree_attn: ", what, " failed: CUDA driver error ", r, " (", msg, ")");
}

void ensure_context(int device_index) {
  const Driver& d = driver();
  CUcontext ctx = nullptr;
  check(d.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx != nullptr) return;
  CUdevice dev = 0;
  check(d.cuDeviceGet(&dev, device_index), "cuDeviceGet");
  check(d.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

const DeviceInfo& device_info(int device_index) {
  TORCH_CHECK(device_index >= 0 && device_index < kMaxDevices, "tree_attn: CUDA device index ", device_index,
              " out of range");
  static std::array<DeviceInfo, kMaxDevices> infos{};
  static std::array<std::once_flag, kMaxDevices> once;
  std::call_once(once[device_index], [device_index] {
    const Driver& d = driver();
    CUdevice dev = 0;
    check(d.cuDeviceGet(&dev, device_index), "cuDeviceGet");
    int major = 0, minor = 0;
    DeviceInfo& info = infos[device_index];
    check(d.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute");
    check(d.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute");
    check(d.cuDeviceGetAttribute(&info.num_sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
          "cuDeviceGetAttribute");
    check(d.cuDeviceGetAttribute(&info.max_shared_optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev),
          "cuDeviceGetAttribute");
    info.arch = major * 10 + minor;
  });
  return infos[device_index];
}

}  // namespace tree_attn::cuda_driver

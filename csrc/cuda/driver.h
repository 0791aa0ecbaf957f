// The few CUDA driver API entry points the launcher needs, loaded from libcuda.so.1 at
// first use (dlopen): the extension links no CUDA library and builds against any torch,
// CPU builds included. Types and constants are the driver API's (cuda.h, CUDA 12/13);
// tests/test_cuda_driver_abi.py checks them against cuda.h where a toolkit is installed.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tree_attn::cuda_driver {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;

inline constexpr CUresult CUDA_SUCCESS = 0;
inline constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97;
inline constexpr int CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1;
inline constexpr int CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3;
inline constexpr int CU_FUNC_ATTRIBUTE_NUM_REGS = 4;
inline constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
inline constexpr int CU_FUNC_CACHE_PREFER_SHARED = 1;

// Tensor maps (TMA descriptors, the Hopper kernel's K/V operands): an opaque 128-byte object
// (aligned as cuda.h 12.x+ aligns it), encoded on the host and passed to the kernel by value.
struct alignas(128) CUtensorMap {
  uint64_t opaque[16];
};
inline constexpr int CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6;
inline constexpr int CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9;
inline constexpr int CU_TENSOR_MAP_INTERLEAVE_NONE = 0;
inline constexpr int CU_TENSOR_MAP_SWIZZLE_128B = 3;
inline constexpr int CU_TENSOR_MAP_L2_PROMOTION_L2_128B = 2;
inline constexpr int CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0;

struct Driver {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuFuncGetAttribute)(int*, int, CUfunction);
  CUresult (*cuFuncSetAttribute)(CUfunction, int, int);
  CUresult (*cuFuncSetCacheConfig)(CUfunction, int);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
  // Enum arguments as int (C enums are int-sized). Null where the driver predates it
  // (CUDA < 12); the Hopper kernel is then not chosen.
  CUresult (*cuTensorMapEncodeTiled)(CUtensorMap*, int data_type, uint32_t rank, void* global_address,
                                     const uint64_t* global_dim, const uint64_t* global_strides,
                                     const uint32_t* box_dim, const uint32_t* element_strides, int interleave,
                                     int swizzle, int l2_promotion, int oob_fill);
};

// The driver, loaded once per process; throws (c10::Error) if libcuda.so.1 is missing.
const Driver& driver();

// Throws c10::Error naming `what` and the driver's message unless `r` is CUDA_SUCCESS.
void check(CUresult r, const char* what);

// Makes the device's primary context current on this thread if none is (torch uses the
// primary context; a thread that has not touched the runtime may have none).
void ensure_context(int device_index);

struct DeviceInfo {
  int arch = 0;         // compute capability, major * 10 + minor (90 for H100/H200)
  int num_sms = 0;
  int max_shared_optin = 0;
};
// Cached per device index.
const DeviceInfo& device_info(int device_index);

}  // namespace tree_attn::cuda_driver

// The MPS backend: our own Metal kernels (a main pass over key splits, then a reduce
// pass), encoded into PyTorch's MPS stream.
//
// Everything is decided before the encoding block: validation (prepare(), the one
// shared check), the launch plan (csrc/plan.h, the same plan the CPU simulator runs),
// scratch and output allocation, pipeline compilation and the device-limit checks. The
// block itself only encodes, because a C++ exception thrown inside dispatch_sync cannot
// propagate and terminates the process.
//
// Offsets are not checked on the host: reading an MPS tensor's values would wait for
// the GPU. prepare(..., ClampInKernel) saturates them to int32 and the kernels clamp
// each to [0, S], so no key outside [0, S) is ever read whatever the offsets hold
// (README, "Offsets").
#include <ATen/ATen.h>
#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>

#include <string>
#include <vector>

#include "backend.h"
#include "metal/plan.h"
#include "pipeline_cache.h"
#include "tree_attn.h"

namespace tree_attn {
namespace {

// An MPS tensor's storage data pointer is the MTLBuffer itself; nil for an empty
// storage (the allocator hands out no buffer for zero bytes).
id<MTLBuffer> storage_buffer(const at::Tensor& t) {
  return __builtin_bit_cast(id<MTLBuffer>, t.storage().data());
}

struct BoundBuffer {
  id<MTLBuffer> buffer = nil;
  NSUInteger offset = 0;
  NSUInteger index = 0;
};

// One launch of the plan, resolved to Metal objects and checked against the device.
struct EncodedLaunch {
  id<MTLComputePipelineState> pipeline = nil;
  MTLSize grid{};
  MTLSize threads{};
  NSUInteger threadgroup_memory_bytes = 0;
  std::vector<BoundBuffer> buffers;
  std::vector<NSUInteger> params_indices;
};

std::string device_name(id<MTLDevice> device) {
  const char* name = device.name.UTF8String;
  return name != nullptr ? std::string(name) : std::string("this GPU");
}

// Metal drops a dispatch that exceeds the pipeline's or the device's limits without any
// error and leaves the output untouched, so every limit is checked here, loudly.
void check_device_limits(const Launch& launch, id<MTLComputePipelineState> pipeline, id<MTLDevice> device) {
  const uint64_t threads = uint64_t(launch.threads[0]) * launch.threads[1] * launch.threads[2];
  const uint64_t pipeline_max_threads = pipeline.maxTotalThreadsPerThreadgroup;
  TORCH_CHECK(threads <= pipeline_max_threads, "tree attention: kernel ", launch.kernel, " needs ", threads,
              " threads per threadgroup, but on ", device_name(device), " its pipeline allows at most ",
              pipeline_max_threads, " (Metal would silently skip the launch)");
  const MTLSize device_max = device.maxThreadsPerThreadgroup;
  const uint64_t max_per_dim[3] = {device_max.width, device_max.height, device_max.depth};
  for (size_t d = 0; d < 3; ++d) {
    TORCH_CHECK(launch.threads[d] <= max_per_dim[d], "tree attention: kernel ", launch.kernel, " needs ",
                launch.threads[d], " threads in threadgroup dimension ", d, ", but ", device_name(device),
                " allows at most ", max_per_dim[d]);
  }
  TORCH_INTERNAL_ASSERT(launch.threadgroup_memory_bytes % 16 == 0,
                        "tree attention: Metal needs threadgroup memory lengths in multiples of 16, the plan "
                        "asks for ",
                        launch.threadgroup_memory_bytes, " bytes for kernel ", launch.kernel);
  const uint64_t memory = uint64_t(launch.threadgroup_memory_bytes) + uint64_t(pipeline.staticThreadgroupMemoryLength);
  const uint64_t device_max_memory = device.maxThreadgroupMemoryLength;
  TORCH_CHECK(memory <= device_max_memory, "tree attention: kernel ", launch.kernel, " needs ", memory,
              " bytes of threadgroup memory, but ", device_name(device), " allows at most ", device_max_memory,
              " (Metal would silently skip the launch)");
}

EncodedLaunch resolve_launch(const Launch& launch, const CallTensors& tensors, id<MTLDevice> device) {
  EncodedLaunch encoded;
  encoded.pipeline = mps::compute_pipeline(device, launch.kernel, launch.constants);
  check_device_limits(launch, encoded.pipeline, device);
  encoded.grid = MTLSizeMake(launch.grid[0], launch.grid[1], launch.grid[2]);
  encoded.threads = MTLSizeMake(launch.threads[0], launch.threads[1], launch.threads[2]);
  encoded.threadgroup_memory_bytes = launch.threadgroup_memory_bytes;

  // A binding the kernel never reads (a zero-size mask when M = 0, empty K/V when
  // S = 0) has no buffer of its own. The kernel still declares the argument, and Metal's
  // validation rejects an unbound one, so it gets the query's buffer, which a non-empty
  // problem always has.
  const BoundBuffer stand_in{storage_buffer(tensors.in.query),
                             NSUInteger(tensors.in.query.storage_offset() * tensors.in.query.element_size()), 0};
  TORCH_INTERNAL_ASSERT(stand_in.buffer != nil, "tree attention: the query of a non-empty call has no MTLBuffer");

  for (const BufferBinding& binding : launch.buffers) {
    if (binding.role == BufferRole::Params) {
      encoded.params_indices.push_back(binding.index);
      continue;
    }
    const at::Tensor& tensor = tensors.tensor_for(binding.role);
    TORCH_INTERNAL_ASSERT(tensor.defined() && tensor.is_mps(), "tree attention: buffer ", role_name(binding.role),
                          " of kernel ", launch.kernel, " is not an MPS tensor");
    BoundBuffer bound{storage_buffer(tensor), NSUInteger(binding.byte_offset), binding.index};
    if (bound.buffer == nil) {
      TORCH_INTERNAL_ASSERT(!binding.writable && tensor.numel() == 0, "tree attention: buffer ",
                            role_name(binding.role), " of kernel ", launch.kernel, " has no MTLBuffer");
      bound.buffer = stand_in.buffer;
      bound.offset = stand_in.offset;
    }
    TORCH_INTERNAL_ASSERT(bound.offset <= bound.buffer.length, "tree attention: buffer ", role_name(binding.role),
                          " bound at byte ", bound.offset, " past the end of its ", bound.buffer.length,
                          "-byte MTLBuffer");
    encoded.buffers.push_back(bound);
  }
  return encoded;
}

// Runs the plan's launches on the current MPS stream. Returns before the GPU runs them:
// PyTorch commits the command buffer when it needs to, like for its own kernels.
void encode_plan(const Plan& plan, const CallTensors& tensors) {
  id<MTLDevice> device = at::mps::MPSDevice::getInstance()->device();
  std::vector<EncodedLaunch> launches;
  launches.reserve(plan.launches.size());
  for (const Launch& launch : plan.launches) launches.push_back(resolve_launch(launch, tensors, device));

  // Blocks capture C++ objects by copy; the block runs synchronously, so pointers to
  // these locals stay valid and nothing is copied.
  const std::vector<EncodedLaunch>* const to_encode = &launches;
  const TreeAttnParams* const params = &plan.params;
  at::mps::MPSStream* const stream = at::mps::getCurrentMPSStream();
  dispatch_sync(stream->queue(), ^{
    @autoreleasepool {
      // PyTorch's open compute encoder, shared with its own kernels: ours are coalesced
      // into it, so we must neither end it nor open another one on the command buffer.
      id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();
      // A serial compute encoder runs its dispatches in order, each seeing the writes of
      // the ones before: the reduce pass reads the main pass's partials without a barrier.
      for (const EncodedLaunch& launch : *to_encode) {
        [encoder setComputePipelineState:launch.pipeline];
        for (const NSUInteger index : launch.params_indices) {
          [encoder setBytes:params length:sizeof(TreeAttnParams) atIndex:index];
        }
        for (const BoundBuffer& bound : launch.buffers) {
          [encoder setBuffer:bound.buffer offset:bound.offset atIndex:bound.index];
        }
        if (launch.threadgroup_memory_bytes > 0) {
          [encoder setThreadgroupMemoryLength:launch.threadgroup_memory_bytes atIndex:0];
        }
        [encoder dispatchThreadgroups:launch.grid threadsPerThreadgroup:launch.threads];
      }
    }
  });
}

// The MPS backend of the one backend interface (csrc/backend.h).
struct MpsBackend {
  static constexpr OffsetCheck kOffsetCheck = OffsetCheck::ClampInKernel;

  static void run(const Prepared& in, at::Tensor& output, at::Tensor& lse) {
    const Plan plan = make_plan(in);
    // Scratch comes from PyTorch's caching allocator. Releasing it when this function
    // returns, before the GPU has run, is safe: the allocator only hands the memory to
    // later work on the same stream, which runs after ours.
    const at::Tensor scratch = at::empty({int64_t(plan.scratch_bytes)}, in.query.options().dtype(at::kByte));
    // The plan binds these three at byte 0: they are fresh, so their storage starts there.
    TORCH_INTERNAL_ASSERT(output.storage_offset() == 0 && lse.storage_offset() == 0 &&
                          scratch.storage_offset() == 0);
    encode_plan(plan, CallTensors{in, scratch, output, lse});
  }
};

}  // namespace

TREE_ATTN_REGISTER_BACKEND(tree_attn, MPS, MpsBackend)

}  // namespace tree_attn

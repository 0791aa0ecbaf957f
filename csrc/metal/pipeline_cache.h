// Compute pipelines for the kernels of shaders/*.metal, compiled on first use.
//
// The shader source is embedded in the extension at build time (setup.py writes
// build/generated/shader_source.h), so the wheel carries no .metallib and the kernels
// are compiled by the Metal driver of the machine that runs them.
#pragma once

#include <Metal/Metal.h>

#include <string>
#include <vector>

#include "metal/function_constant.h"

namespace tree_attn::mps {

using ::tree_attn::FunctionConstant;

// The pipeline of the kernel whose host name is `kernel_name` (a template instantiation
// in shaders/tree_attention.metal, as named by the launch plan). The first call compiles
// the whole embedded source as one library (MSL 3.1, fast math off); pipelines are then
// cached for the life of the process. Thread-safe. Raises a Python RuntimeError carrying
// Metal's compiler log if the source does not compile, or naming the kernel if the
// library lacks it. Must be called outside any dispatch_sync block: it may throw.
//
// With function-constant values the pipeline is that kernel specialised with them
// (MTLFunctionConstantValues); a kernel name plus its constants is one cache entry
// (pipeline_key), so each specialisation compiles once.
id<MTLComputePipelineState> compute_pipeline(id<MTLDevice> device, const std::string& kernel_name,
                                             const std::vector<FunctionConstant>& constants = {});

}  // namespace tree_attn::mps

// See pipeline_cache.h.
#include "pipeline_cache.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <unordered_map>

#include "shader_source.h"

namespace tree_attn::mps {
namespace {

std::string describe(NSError* error) {
  if (error == nil) return "(Metal gave no error description)";
  const char* text = error.localizedDescription.UTF8String;
  return text != nullptr ? std::string(text) : std::string("(error description is not UTF-8)");
}

MTLDataType metal_data_type(FunctionConstantType type) {
  switch (type) {
    case FunctionConstantType::Bool: return MTLDataTypeBool;
    case FunctionConstantType::Char: return MTLDataTypeChar;
    case FunctionConstantType::UChar: return MTLDataTypeUChar;
    case FunctionConstantType::Short: return MTLDataTypeShort;
    case FunctionConstantType::UShort: return MTLDataTypeUShort;
    case FunctionConstantType::Int: return MTLDataTypeInt;
    case FunctionConstantType::UInt: return MTLDataTypeUInt;
    case FunctionConstantType::Half: return MTLDataTypeHalf;
    case FunctionConstantType::Float: return MTLDataTypeFloat;
  }
  TORCH_INTERNAL_ASSERT(false, "tree attention: unknown function constant type");
}

class PipelineCache {
 public:
  id<MTLComputePipelineState> get(id<MTLDevice> device, const std::string& kernel_name,
                                  const std::vector<FunctionConstant>& constants) {
    std::lock_guard<std::mutex> lock(mutex_);
    // PyTorch drives a single Metal device, so one library serves every call.
    TORCH_INTERNAL_ASSERT(device_ == nil || device_ == device,
                          "tree attention: the MPS device changed during the process");
    device_ = device;
    const std::string key = pipeline_key(kernel_name, constants);
    const auto cached = pipelines_.find(key);
    if (cached != pipelines_.end()) return cached->second;

    // Objective-C temporaries live in an autorelease pool that must be popped normally,
    // so errors are carried out of it and raised after.
    std::string failure;
    id<MTLComputePipelineState> pipeline = nil;
    @autoreleasepool {
      if (library_ == nil && library_failure_.empty()) compile_library();
      if (library_ == nil) {
        failure = library_failure_;
      } else {
        pipeline = build_pipeline(kernel_name, constants, failure);
      }
    }
    TORCH_CHECK(pipeline != nil, failure);
    pipelines_.emplace(key, pipeline);
    return pipeline;
  }

 private:
  // A failed compile is remembered: the source cannot change within the process, and
  // every later call should fail as fast and with the same log.
  void compile_library() {
    MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
    // bfloat needs MSL 3.1 (macOS 14, PyTorch's minimum for MPS).
    options.languageVersion = MTLLanguageVersion3_1;
    // The kernels mark masked scores with -INFINITY and compare against it; fast math
    // lets the compiler assume no infinities exist. (mathMode replaces this property
    // from macOS 15 on, but macOS 14 lacks it.)
    options.fastMathEnabled = NO;
    NSString* source = [NSString stringWithUTF8String:kShaderSource];
    if (source == nil) {
      library_failure_ = "tree attention: the embedded shader source is not valid UTF-8";
      return;
    }
    NSError* error = nil;
    library_ = [device_ newLibraryWithSource:source options:options error:&error];
    if (library_ == nil) {
      library_failure_ =
          "tree attention: Metal failed to compile shaders/*.metal (MSL 3.1) on " +
          std::string(device_.name.UTF8String != nullptr ? device_.name.UTF8String : "this GPU") +
          ". Compiler log:\n" + describe(error);
    }
  }

  id<MTLComputePipelineState> build_pipeline(const std::string& kernel_name,
                                             const std::vector<FunctionConstant>& constants, std::string& failure) {
    NSString* name = [NSString stringWithUTF8String:kernel_name.c_str()];
    NSError* error = nil;
    id<MTLFunction> function = nil;
    if (name != nil && constants.empty()) {
      function = [library_ newFunctionWithName:name];
    } else if (name != nil) {
      // Specialised: Metal copies each value when it is set.
      MTLFunctionConstantValues* values = [[MTLFunctionConstantValues alloc] init];
      for (const FunctionConstant& c : constants)
        [values setConstantValue:c.data() type:metal_data_type(c.type) atIndex:NSUInteger(c.index)];
      function = [library_ newFunctionWithName:name constantValues:values error:&error];
      if (function == nil && error != nil) {
        failure = "tree attention: Metal could not specialise kernel '" + kernel_name + "' with function constants " +
                  pipeline_key(kernel_name, constants) + ": " + describe(error);
        return nil;
      }
    }
    if (function == nil) {
      failure = "tree attention: shaders/tree_attention.metal has no kernel named '" + kernel_name +
                "' (the launch plan in csrc/plan.cpp and the shader's host_name instantiations disagree)";
      return nil;
    }
    error = nil;
    id<MTLComputePipelineState> pipeline = [device_ newComputePipelineStateWithFunction:function error:&error];
    if (pipeline == nil) {
      failure = "tree attention: Metal could not build the compute pipeline of kernel '" + kernel_name +
                "': " + describe(error);
    }
    return pipeline;
  }

  std::mutex mutex_;
  id<MTLDevice> device_ = nil;
  id<MTLLibrary> library_ = nil;
  std::string library_failure_;
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
};

}  // namespace

id<MTLComputePipelineState> compute_pipeline(id<MTLDevice> device, const std::string& kernel_name,
                                             const std::vector<FunctionConstant>& constants) {
  // Deliberately never destroyed: releasing Metal objects from a static destructor at
  // process exit can run after the Metal runtime itself is torn down.
  static PipelineCache* const cache = new PipelineCache();
  return cache->get(device, kernel_name, constants);
}

}  // namespace tree_attn::mps

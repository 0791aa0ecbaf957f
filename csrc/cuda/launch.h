// The CUDA backend's launch of one call: the plan (triton_plan.h), the kernel specs it
// needs, and the kernels' arguments. plan_launch() is pure host code (no device is
// touched), so the CPU tests can check which kernels a call would use.
#pragma once

#include <ATen/ATen.h>

#include "cuda/kernel_registry.h"
#include "cuda/triton_plan.h"
#include "tree_attn.h"

namespace tree_attn::cuda {

struct Launch {
  triton::Plan plan;
  KernelSpec main;
  KernelSpec reduce;      // used only when plan.num_splits > 1
  at::Tensor query;       // Q * sign(scale) (negated, exactly, for a negative scale)
  at::Tensor key, value;  // contiguous copies where a tile's int32 offsets would not fit
  bool split() const { return plan.num_splits > 1; }
};

// The launch of a prepared call on a GPU of compute capability `arch` with `num_sms` SMs.
// `num_splits` / `config` override the plan (tests, tuning).
Launch plan_launch(const Prepared& in, int arch, int num_sms, std::optional<int> num_splits = std::nullopt,
                   std::optional<triton::TileConfig> config = std::nullopt);

// Runs a prepared, non-empty call on the current CUDA stream of its device, writing out/lse.
void run(const Prepared& in, at::Tensor& out, at::Tensor& lse, std::optional<int> num_splits = std::nullopt,
         std::optional<triton::TileConfig> config = std::nullopt);

}  // namespace tree_attn::cuda

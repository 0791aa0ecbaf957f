// The CUDA backend's launch of one call: the plan (triton_plan.h), the kernel specs it
// needs, and the kernels' arguments. plan_launch() is pure host code (no device is
// touched), so the CPU tests can check which kernels a call would use.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "cuda/kernel_registry.h"
#include "cuda/triton_plan.h"
#include "tree_attn.h"

namespace tree_attn::cuda {

// Which main kernel a call may use. Auto: the Hopper kernel on sm_90 for every call it
// covers (hopper_why_not), else the Triton kernel. The process default is Triton; it comes
// from TORCH_TREE_ATTN_CUDA_KERNEL (auto / triton / hopper), set at import (torch_tree_attn.backends.cuda).
enum class KernelChoice : int { Auto = 0, Triton = 1, Hopper = 2 };
void set_default_choice(KernelChoice choice);
KernelChoice default_choice();

struct Launch {
  triton::Plan plan;
  KernelSpec main;
  KernelSpec reduce;      // used only when plan.num_splits > 1
  at::Tensor query;       // Q * sign(scale) (negated, exactly, for a negative scale)
  at::Tensor key, value;  // contiguous copies where a tile's int32 offsets would not fit
  bool split() const { return plan.num_splits > 1; }
};

// Why the Hopper kernel cannot run a prepared call on a GPU of compute capability `arch`
// (empty when it can): the architecture, dtypes, head dim, or a K/V that TMA cannot address
// (base or a stride not a 16-byte multiple), S outside [1, 2^31).
std::string hopper_why_not(const Prepared& in, int arch);

// The launch of a prepared call on a GPU of compute capability `arch` with `num_sms` SMs.
// `num_splits` / `config` override the plan (tests, tuning; a Triton tile `config` implies
// the Triton kernel); `choice` nullopt = the process default. Choosing Hopper for a call it
// does not cover throws c10::ValueError with the reason.
Launch plan_launch(const Prepared& in, int arch, int num_sms, std::optional<int> num_splits = std::nullopt,
                   std::optional<triton::TileConfig> config = std::nullopt,
                   std::optional<KernelChoice> choice = std::nullopt);

// Runs a prepared, non-empty call on the current CUDA stream of its device, writing out/lse.
void run(const Prepared& in, at::Tensor& out, at::Tensor& lse, std::optional<int> num_splits = std::nullopt,
         std::optional<triton::TileConfig> config = std::nullopt, std::optional<KernelChoice> choice = std::nullopt);

}  // namespace tree_attn::cuda

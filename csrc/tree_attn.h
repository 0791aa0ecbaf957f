// The one description of a validated tree-attention call, shared by every backend.
//
// `check_contract()` is the only place the op contract's rules live: `prepare()` runs it
// for every backend, and the fake implementation (torch_tree_attn/_fake.py) runs it on
// the metadata of fake tensors. Backends receive a `Prepared` whose tensors already
// satisfy: stride(-1) == 1 for q/k/v, a mask that is either bool or float32, offsets
// that are int32 (or absent), and a `Problem` with all sizes and element strides the
// kernels need.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace tree_attn {

enum class MaskKind : int32_t { Bool = 0, Additive = 1 };

struct Problem {
  int64_t B = 0;    // batch rows
  int64_t Hq = 0;   // query heads
  int64_t Hkv = 0;  // key/value heads
  int64_t G = 0;    // Hq / Hkv, query heads per kv head
  int64_t T = 0;    // tree nodes (queries) per batch row
  int64_t S = 0;    // key/value capacity
  int64_t D = 0;    // head dim
  int64_t M = 0;    // mask window width: keys [off_b, off_b + M) follow the mask
  at::ScalarType q_dtype = at::kFloat;   // query and output
  at::ScalarType kv_dtype = at::kFloat;  // key and value: q_dtype, or f16/bf16 under an f32 query

  // Element strides, ordered (batch, head, row, dim) for q/k/v and
  // (batch, query head, query row, window column) for the mask; broadcast dims are 0.
  int64_t q_stride[4] = {0, 0, 0, 0};
  int64_t k_stride[4] = {0, 0, 0, 0};
  int64_t v_stride[4] = {0, 0, 0, 0};
  int64_t mask_stride[4] = {0, 0, 0, 0};
  MaskKind mask_kind = MaskKind::Bool;

  bool has_mask_offset = false;
  bool has_sinks = false;
  float scale = 1.0f;
  float softcap = 0.0f;  // 0 means off

  bool empty() const { return B == 0 || Hq == 0 || T == 0; }
};

struct Prepared {
  at::Tensor query, key, value;  // stride(-1) == 1
  at::Tensor mask;               // bool or float32, original (broadcast) strides
  at::Tensor mask_offset;        // int32 [B] contiguous, undefined when has_mask_offset is false
  at::Tensor sinks;              // float32 [Hq] contiguous, undefined when has_sinks is false
  Problem p;
};

// A tensor argument as the contract sees it: metadata only (the sizes and strides are
// borrowed, not owned).
struct ArgInfo {
  c10::IntArrayRef sizes, strides;
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);

  int64_t dim() const { return int64_t(sizes.size()); }
  static ArgInfo of(const at::Tensor& t);
};

// Every rule of the op contract that metadata can decide: ranks, devices, dtypes,
// shapes, GQA divisibility, supported D, overflow-checked index ranges, scale, softcap
// and sinks. Returns the problem's sizes (strides are left to prepare()); throws
// c10::ValueError / c10::TypeError naming the argument and the values seen.
// `mask_offset` and `sinks` are null when the call has none.
Problem check_contract(const ArgInfo& query, const ArgInfo& key, const ArgInfo& value, const ArgInfo& mask,
                       const ArgInfo* mask_offset, c10::optional<double> scale, c10::optional<double> softcap,
                       const ArgInfo* sinks);

// Where the offsets live decides what can be checked: reading them on MPS/CUDA would
// force a device sync, so there kernels clamp instead (see README, "Offsets").
//   OnHost        checked here (CPU); Prepared::mask_offset is int32.
//   ClampInKernel the kernels clamp; Prepared::mask_offset is int32, int64 saturated (Metal
//                 reads int32 only), which costs a conversion kernel for int64 offsets.
//   ClampInKernelAnyInt the kernels clamp and read int32 or int64 as given (the Triton
//                 kernels): Prepared::mask_offset is the caller's tensor, made contiguous.
enum class OffsetCheck { OnHost, ClampInKernel, ClampInKernelAnyInt };

Prepared prepare(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                 const at::Tensor& mask, const c10::optional<at::Tensor>& mask_offset,
                 c10::optional<double> scale, c10::optional<double> softcap,
                 const c10::optional<at::Tensor>& sinks, OffsetCheck offset_check);

// Output buffers with the layout every backend (and the fake) returns.
at::Tensor empty_output(const Prepared& in);
at::Tensor empty_lse(const Prepared& in);

}  // namespace tree_attn

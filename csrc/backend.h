// The one backend interface. Every backend's `forward` and `forward_with_lse` are the
// two functions below: prepare (the contract's validation, shared by every backend),
// allocate (the outputs every backend and the fake return), then the backend's run.
//
// A backend is a type with
//   static constexpr OffsetCheck kOffsetCheck;  // where its offsets can be checked
//   static void run(const Prepared& in, at::Tensor& out, at::Tensor& lse);
// `run` is called for non-empty problems only, with `out` and `lse` from
// empty_output()/empty_lse(), and writes every element of both.
#pragma once

#include <torch/library.h>

#include <tuple>
#include <utility>

#include "tree_attn.h"

namespace tree_attn {

template <class Backend>
std::tuple<at::Tensor, at::Tensor> forward_with_lse(const at::Tensor& query, const at::Tensor& key,
                                                    const at::Tensor& value, const at::Tensor& mask,
                                                    const c10::optional<at::Tensor>& mask_offset,
                                                    c10::optional<double> scale, c10::optional<double> softcap,
                                                    const c10::optional<at::Tensor>& sinks) {
  const Prepared in = prepare(query, key, value, mask, mask_offset, scale, softcap, sinks, Backend::kOffsetCheck);
  at::Tensor out = empty_output(in);
  at::Tensor lse = empty_lse(in);
  if (!in.p.empty()) Backend::run(in, out, lse);
  return {std::move(out), std::move(lse)};
}

// Every backend computes the lse anyway (one float per query row; the split merge needs it).
template <class Backend>
at::Tensor forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask,
                   const c10::optional<at::Tensor>& mask_offset, c10::optional<double> scale,
                   c10::optional<double> softcap, const c10::optional<at::Tensor>& sinks) {
  return std::get<0>(forward_with_lse<Backend>(query, key, value, mask, mask_offset, scale, softcap, sinks));
}

}  // namespace tree_attn

// Registers `Backend` as the `forward` and `forward_with_lse` kernels of library `ns` for
// `dispatch_key`.
#define TREE_ATTN_REGISTER_BACKEND(ns, dispatch_key, Backend)                 \
  TORCH_LIBRARY_IMPL(ns, dispatch_key, m) {                                  \
    m.impl("forward", &::tree_attn::forward<Backend>);                       \
    m.impl("forward_with_lse", &::tree_attn::forward_with_lse<Backend>);     \
  }

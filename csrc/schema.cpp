// The operator schema: one TORCH_LIBRARY for every backend (backends register their
// kernels with TREE_ATTN_REGISTER_BACKEND in their own files), and the Python module
// torch_tree_attn._C, whose one function lets the fake implementation check a call with
// the contract's own rules.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "schema.h"
#include "tree_attn.h"

TORCH_LIBRARY(tree_attn, m) {
  m.def("forward" TREE_ATTN_SCHEMA_ARGS " -> Tensor");
  m.def("forward_with_lse" TREE_ATTN_SCHEMA_ARGS " -> (Tensor, Tensor)");
}

namespace {

// (sizes, strides, dtype, device) of a tensor argument: what a fake tensor can tell.
using ArgMeta = std::tuple<std::vector<int64_t>, std::vector<int64_t>, at::ScalarType, at::Device>;

tree_attn::ArgInfo info(const ArgMeta& meta) {
  return tree_attn::ArgInfo{std::get<0>(meta), std::get<1>(meta), std::get<2>(meta), std::get<3>(meta)};
}

void check_contract(const ArgMeta& query, const ArgMeta& key, const ArgMeta& value, const ArgMeta& mask,
                    const std::optional<ArgMeta>& mask_offset, std::optional<double> scale,
                    std::optional<double> softcap, const std::optional<ArgMeta>& sinks) {
  // The contract's ValueError/TypeError, as Python's, whatever pybind11 build torch uses.
  try {
    const tree_attn::ArgInfo offsets = mask_offset ? info(*mask_offset) : tree_attn::ArgInfo{};
    const tree_attn::ArgInfo sink_info = sinks ? info(*sinks) : tree_attn::ArgInfo{};
    tree_attn::check_contract(info(query), info(key), info(value), info(mask), mask_offset ? &offsets : nullptr,
                              scale, softcap, sinks ? &sink_info : nullptr);
  } catch (const c10::ValueError& e) {
    throw pybind11::value_error(e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    throw pybind11::type_error(e.what_without_backtrace());
  }
}

// The internal entry of the Python (Triton) CUDA backend: the shared prepare() with
// OffsetCheck::ClampInKernelAnyInt (offsets never read on the host, so no device sync and
// the call is capturable in a CUDA graph; int64 offsets need no conversion kernel),
// returning what a launcher needs. No validation
// happens anywhere else.
//   (query, key, value, mask, offsets|None, sinks|None, ints, scale, softcap|None)
//   query/key/value: stride(-1) == 1; mask: bool or float32, original (broadcast) strides;
//   offsets: int32 or int64 [B] contiguous, as given; sinks: float32 [Hq];
//   ints: [B, Hq, Hkv, G, T, S, D, M, mask_is_float,
//          q_stride x4, k_stride x4, v_stride x4, mask_stride x4]  (element strides,
//          (batch, head, row, dim/column), broadcast dims 0)
using PrepareResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>,
                                 std::optional<at::Tensor>, std::vector<int64_t>, double, std::optional<double>>;

PrepareResult prepare_for_launcher(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                   const at::Tensor& mask, const std::optional<at::Tensor>& mask_offset,
                                   std::optional<double> scale, std::optional<double> softcap,
                                   const std::optional<at::Tensor>& sinks) {
  try {
    const tree_attn::Prepared in = tree_attn::prepare(query, key, value, mask, mask_offset, scale, softcap, sinks,
                                                      tree_attn::OffsetCheck::ClampInKernelAnyInt);
    const auto& p = in.p;
    std::vector<int64_t> ints = {p.B, p.Hq, p.Hkv, p.G, p.T, p.S, p.D, p.M,
                                 p.mask_kind == tree_attn::MaskKind::Additive ? 1 : 0};
    for (const int64_t* st : {p.q_stride, p.k_stride, p.v_stride, p.mask_stride})
      ints.insert(ints.end(), st, st + 4);
    std::optional<at::Tensor> offsets, sink_t;
    if (p.has_offsets) offsets = in.offsets;
    if (p.has_sinks) sink_t = in.sinks;
    std::optional<double> cap;
    if (p.softcap > 0.0f) cap = double(p.softcap);
    return {in.query, in.key, in.value, in.mask, offsets, sink_t, ints, double(p.scale), cap};
  } catch (const c10::ValueError& e) {
    throw pybind11::value_error(e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    throw pybind11::type_error(e.what_without_backtrace());
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_tree_attn's C++ extension: importing it registers the tree_attn operators";
  m.def("check_contract", &check_contract, "Checks a call's metadata against the op contract (for the fakes).");
  m.def("_prepare", &prepare_for_launcher,
        "The shared prepare() with in-kernel offset clamping, for the Python CUDA (Triton) launcher.");
}

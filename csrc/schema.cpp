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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_tree_attn's C++ extension: importing it registers the tree_attn operators";
  m.def("check_contract", &check_contract, "Checks a call's metadata against the op contract (for the fakes).");
}

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

#include "cuda/bindings.h"
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

// The shared prepare() for the Triton interpreter launcher (torch_tree_attn/backends/cuda/__init__.py),
// with OffsetCheck::ClampInKernelAnyInt as the C++ CUDA backend uses it: offsets are never
// read on the host. Returns the typed Prepared (bound below). No validation happens
// anywhere else.
tree_attn::Prepared prepare_for_launcher(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                         const at::Tensor& mask, const std::optional<at::Tensor>& mask_offset,
                                         std::optional<double> scale, std::optional<double> softcap,
                                         const std::optional<at::Tensor>& sinks) {
  try {
    return tree_attn::prepare(query, key, value, mask, mask_offset, scale, softcap, sinks,
                              tree_attn::OffsetCheck::ClampInKernelAnyInt);
  } catch (const c10::ValueError& e) {
    throw pybind11::value_error(e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    throw pybind11::type_error(e.what_without_backtrace());
  }
}

std::vector<int64_t> strides4(const int64_t* s) { return std::vector<int64_t>(s, s + 4); }

std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  using tree_attn::Prepared;
  using tree_attn::Problem;
  m.doc() = "torch_tree_attn's C++ extension: importing it registers the tree_attn operators";
  m.def("check_contract", &check_contract, "Checks a call's metadata against the op contract (for the fakes).");

  py::class_<Problem>(m, "Problem", "A validated call's sizes, strides and options (csrc/tree_attn.h).")
      .def_readonly("B", &Problem::B)
      .def_readonly("Hq", &Problem::Hq)
      .def_readonly("Hkv", &Problem::Hkv)
      .def_readonly("G", &Problem::G)
      .def_readonly("T", &Problem::T)
      .def_readonly("S", &Problem::S)
      .def_readonly("D", &Problem::D)
      .def_readonly("M", &Problem::M)
      .def_property_readonly("q_stride", [](const Problem& p) { return strides4(p.q_stride); })
      .def_property_readonly("k_stride", [](const Problem& p) { return strides4(p.k_stride); })
      .def_property_readonly("v_stride", [](const Problem& p) { return strides4(p.v_stride); })
      .def_property_readonly("mask_stride", [](const Problem& p) { return strides4(p.mask_stride); })
      .def_property_readonly("mask_float", [](const Problem& p) { return p.mask_kind == tree_attn::MaskKind::Additive; })
      .def_readonly("has_mask_offset", &Problem::has_mask_offset)
      .def_readonly("has_sinks", &Problem::has_sinks)
      .def_readonly("scale", &Problem::scale)
      .def_property_readonly("softcap", [](const Problem& p) {
        return p.softcap > 0.0f ? std::optional<double>(p.softcap) : std::nullopt;
      })
      .def_property_readonly("empty", &Problem::empty);
  py::class_<Prepared>(m, "Prepared", "A validated call: its tensors as the kernels read them, and its Problem.")
      .def_readonly("query", &Prepared::query)
      .def_readonly("key", &Prepared::key)
      .def_readonly("value", &Prepared::value)
      .def_readonly("mask", &Prepared::mask)
      .def_property_readonly("mask_offset", [](const Prepared& p) { return defined_or_none(p.mask_offset); })
      .def_property_readonly("sinks", [](const Prepared& p) { return defined_or_none(p.sinks); })
      .def_readonly("problem", &Prepared::p)
      .def("empty_output", &tree_attn::empty_output, "The output every backend fills: [B, Hq, T, D], the query's dtype.")
      .def("empty_lse", &tree_attn::empty_lse, "The lse every backend fills: [B, Hq, T], float32.");
  m.def("_prepare", &prepare_for_launcher,
        "The shared prepare() with in-kernel offset clamping (the Triton interpreter launcher's).");
  tree_attn::cuda::bind(m);
}

#pragma once

#include <pybind11/pybind11.h>

namespace tree_attn::cuda {
// Adds the CUDA backend's host-side functions to the module (csrc/cuda/bindings.cpp).
void bind(pybind11::module_& m);
}  // namespace tree_attn::cuda

// The operator schema: one TORCH_LIBRARY for every backend. Backends register
// implementations with TORCH_LIBRARY_IMPL in their own files.
#include <Python.h>
#include <torch/library.h>

// Importing torch_tree_attn._C only has to run the static registrations below.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

#define TREE_ATTN_ARGS                                                                 \
  "(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor? mask_offset=None, " \
  "float? scale=None, float? softcap=None)"

TORCH_LIBRARY(tree_attn, m) {
  m.def("forward" TREE_ATTN_ARGS " -> Tensor");
  m.def("forward_with_lse" TREE_ATTN_ARGS " -> (Tensor, Tensor)");
  // The Metal shaders executed by the CPU simulator of the Metal Shading Language
  // (csrc/sim), with the launch plan the MPS backend uses. CPU tensors only.
  m.def("_metal_sim_forward" TREE_ATTN_ARGS " -> Tensor");
  m.def("_metal_sim_forward_with_lse" TREE_ATTN_ARGS " -> (Tensor, Tensor)");
}

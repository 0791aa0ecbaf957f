// The Python module torch_tree_attn_sim._C: importing it only has to run the static
// operator registrations of sim_forward.cpp and sim_ops.cpp.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

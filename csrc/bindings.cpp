// The Python module macs_kernels._C. Loading its library runs the TORCH_LIBRARY_IMPL blocks of
// csrc/<op>/launch.cu, which register CUDA kernels for the operators macs_kernels/ops/<op>.py defines; the module
// itself holds no functions.
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

// Registers the CUDA kernels of the operators that macs_kernels/ops/library.py defines (schemas, CPU
// kernels, fake kernels), and makes this library importable as the Python module macs_kernels._C.
#include <Python.h>
#include <torch/library.h>

#include "launchers.h"

TORCH_LIBRARY_IMPL(macs_kernels, CUDA, m) {
  m.impl("macs_update", &macs::macs_update_cuda);
  m.impl("macs_update_rows", &macs::macs_update_rows_cuda);
  m.impl("macs_zscore", &macs::macs_zscore_cuda);
  m.impl("decode_attention", &macs::decode_attention_cuda);
  m.impl("attention_features", &macs::attention_features_cuda);
}

// Importing the module runs the registration above; the module itself has no attributes.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

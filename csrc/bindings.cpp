// The Python module macs_kernels._C. Loading its library runs the TORCH_LIBRARY_IMPL blocks of
// csrc/<op>/launch.cu, which register CUDA kernels for the operators macs_kernels/ops/<op>.py defines; the module
// itself holds no functions.
#include <Python.h>

#include <cstdlib>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  // The split kernel is chosen by shape (split_kv/policy.cuh): a setting of the removed switch is named, not ignored
  // in silence.
  if (std::getenv("MACS_KERNELS_CUDA_SPLIT_KV") != nullptr &&
      PyErr_WarnEx(PyExc_UserWarning,
                   "MACS_KERNELS_CUDA_SPLIT_KV is no longer read: the cuda backend chooses its split kernel by shape "
                   "(docs/backends.md, \"Split-KV kernels\")",
                   1) < 0) {
    return nullptr;
  }
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

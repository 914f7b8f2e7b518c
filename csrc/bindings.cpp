// The Python module macs_kernels._C. Loading its library runs the TORCH_LIBRARY_IMPL blocks of
// csrc/<op>/launch.cu, which register CUDA kernels for the operators macs_kernels/ops/<op>.py defines. Its two
// functions get and set the split kernel of the split-KV ops (split_kv_choice.h); macs_kernels.ops.cuda
// wraps them.
#include <Python.h>

#include "split_kv_choice.h"

namespace {

PyObject* split_kv_kernel(PyObject*, PyObject*) {
  const int choice = macs::current_split_kernel();
  if (choice < 0) {
    PyErr_Format(PyExc_ValueError, "%s='%s' names no split kernel; choose '%s', '%s' or '%s'",
                 macs::kSplitKernelVariable, std::getenv(macs::kSplitKernelVariable), macs::kSplitKernelNames[0],
                 macs::kSplitKernelNames[1], macs::kSplitKernelNames[2]);
    return nullptr;
  }
  return PyUnicode_FromString(macs::kSplitKernelNames[choice]);
}

PyObject* set_split_kv_kernel(PyObject*, PyObject* name) {
  const char* text = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : nullptr;
  const int choice = text == nullptr ? -1 : macs::split_kernel_from_name(text);
  if (choice < 0) {
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError, "no split kernel %R; choose '%s', '%s' or '%s'", name,
                 macs::kSplitKernelNames[0], macs::kSplitKernelNames[1], macs::kSplitKernelNames[2]);
    return nullptr;
  }
  macs::split_kernel_choice().store(choice);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"split_kv_kernel", split_kv_kernel, METH_NOARGS, "The split kernel the split-KV ops launch."},
    {"set_split_kv_kernel", set_split_kv_kernel, METH_O,
     "Choose the split kernel: 'verified', 'pipelined' or 'mma'."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module);
}

// The emulated build's stand-in for c10's CUDA stream and device guard (csrc/emulation/cpu.h): the launchers take
// CPU tensors, and their operators are registered for the CPU.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#undef TORCH_LIBRARY_IMPL
#define TORCH_LIBRARY_IMPL(ns, k, m) _TORCH_LIBRARY_IMPL(ns, CPU, m, C10_UID)
#define is_cuda() is_cpu()

namespace c10::cuda {

struct CUDAStream {
  operator cudaStream_t() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream() { return {}; }

struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};

}  // namespace c10::cuda

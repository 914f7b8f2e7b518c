// Which split kernel the cuda backend's split-KV ops launch (torch-free, CUDA-free: bindings.cpp includes it too).
// "pipelined" (split_kv_pipelined/kernel.cuh) is the default: exact on an H200 (log c within 5e-7 of a float64
// reference, fp32 and bf16) and 1.5-2.0x faster than "verified" (split_kv/kernel.cuh's split_kernel, which passed
// the GPU tests and compute-sanitizer first); shapes it does not cover (pipelined_fits) run split_kernel. Another is
// chosen by MACS_KERNELS_CUDA_SPLIT_KV, read at the first launch, or at run time through
// macs_kernels.ops.cuda.set_cuda_split_kv_kernel. "mma" (split_kv_mma/kernel.cuh, tensor cores; not yet run on a
// GPU): shapes it does not cover (mma_fits: fp32, other D) run what "pipelined" runs.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace macs {

enum class SplitKernel : int { kVerified = 0, kPipelined = 1, kMma = 2 };
constexpr int kSplitKernelCount = 3;
constexpr const char* kSplitKernelNames[kSplitKernelCount] = {"verified", "pipelined", "mma"};
constexpr const char* kSplitKernelVariable = "MACS_KERNELS_CUDA_SPLIT_KV";

// The kernel named `name`, or -1.
inline int split_kernel_from_name(const char* name) {
  for (int i = 0; i < kSplitKernelCount; ++i) {
    if (std::strcmp(name, kSplitKernelNames[i]) == 0) return i;
  }
  return -1;
}

// The choice of this process: -1 until the environment is read or a kernel is set (one copy in the extension).
inline std::atomic<int>& split_kernel_choice() {
  static std::atomic<int> choice{-1};
  return choice;
}

// The chosen kernel, reading MACS_KERNELS_CUDA_SPLIT_KV (unset or empty: pipelined) on the first call; -1 when the
// variable names no kernel.
inline int current_split_kernel() {
  int choice = split_kernel_choice().load();
  if (choice >= 0) return choice;
  const char* value = std::getenv(kSplitKernelVariable);
  choice = value == nullptr || *value == '\0' ? int(SplitKernel::kPipelined) : split_kernel_from_name(value);
  if (choice >= 0) split_kernel_choice().store(choice);
  return choice;
}

}  // namespace macs

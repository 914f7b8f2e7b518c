// The Python module macs_kernels._C. Loading its library runs the TORCH_LIBRARY_IMPL blocks of
// csrc/<op>/launch.cu, which register CUDA kernels for the operators macs_kernels/ops/<op>.py defines; the module
// itself holds no functions.
#include <Python.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include <cuda_runtime.h>

// Defined here, declared in common.cuh (which a C++ compiler cannot read: its launcher uses <<<>>>).
namespace macs {
namespace {

int dependent_launches_from_environment() {
  const char* value = std::getenv("MACS_KERNELS_CUDA_PDL");
  return value != nullptr && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
}

// Read when the library loads. The functions that touch it are left out of the CPU emulation's thread-sanitizer
// instrumentation, whose runtime (csrc/emulation/runtime.cpp) counts plain accesses and has no atomic callbacks.
std::atomic<int> dependent_launch_setting{dependent_launches_from_environment()};
std::atomic<long long> dependent_launches_made{0};

}  // namespace

__attribute__((no_sanitize("thread"))) bool dependent_launches() {
  return dependent_launch_setting.load(std::memory_order_relaxed) != 0;
}

__attribute__((no_sanitize("thread"))) void count_dependent_launch() {
  dependent_launches_made.fetch_add(1, std::memory_order_relaxed);
}

bool waits_for_prior_grid(const void* kernel) {
#ifdef MACS_CPU_EMULATION
  (void)kernel;
  return true;
#else
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, bool> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find({kernel, device});
  if (found != known.end()) return found->second;
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    (void)cudaGetLastError();  // not the launch's error: the launch goes plain, and the next query asks again
    return false;
  }
  const bool waits = attributes.ptxVersion >= 90;
  known[{kernel, device}] = waits;
  return waits;
#endif
}

cudaError_t allow_dynamic_shared(const void* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;  // granted to every kernel
  int device = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> granted;
  const std::lock_guard<std::mutex> lock(mutex);
  size_t& grant = granted[{kernel, device}];
  if (bytes <= grant) return cudaSuccess;
  error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (error == cudaSuccess) grant = bytes;
  return error;
}

}  // namespace macs

// Sets whether later split passes launch their combine and head pooling as programmatic dependents (common.cuh);
// returns the previous setting. Called through ctypes (macs_kernels.ops.cuda.dependent_launches).
extern "C" __attribute__((no_sanitize("thread"))) int macs_kernels_set_dependent_launches(int enabled) {
  return macs::dependent_launch_setting.exchange(enabled != 0);
}

// How many launches have been made as programmatic dependents since the library loaded (the CPU emulation's record
// its launch log instead).
extern "C" __attribute__((no_sanitize("thread"))) long long macs_kernels_dependent_launches_made() {
  return macs::dependent_launches_made.load(std::memory_order_relaxed);
}

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

// The cuda backend's kernels compiled for the CPU (macs_kernels/ops/cuda/emulation.py): this header comes first in
// every translation unit of that build (g++ -include). Each CUDA thread of a block is a fiber (its own stack, one
// OS thread for the block, a switch only where a thread waits); the blocks of a grid run one after another.
// __syncthreads and __syncwarp are barriers (a barrier that some threads never reach aborts, naming the kernel's
// block, instead of hanging); a shuffle, an mma.sync and an ldmatrix are
// computed from what every lane of the warp puts in, as the PTX ISA defines them; a cp.async writes NaN bytes into
// shared memory when it is issued and its data when its group is waited for, so a read that the kernel's waits and
// barriers do not order after the copy sees NaN. Shared memory (dynamic, and a kernel's __shared__ arrays) is NaN
// bytes when a block starts, and the dynamic part ends at a page no access may touch. What would fault or fail on
// the GPU fails the launch here, naming why: a 16-byte copy or an ldmatrix row not 16-byte aligned, a warp-collective
// operation after lanes of the warp exited, more threads than the kernel's __launch_bounds__, __trap.
//
// Why: a GPU is lent to few sessions, and kernels written without one failed on first contact. This runs the same
// source, launch code and host policy on CPU tensors with the same tests; what it cannot show is speed and what
// depends on the hardware's scheduling (compute-sanitizer's racecheck and the GPU preset still do).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __launch_bounds__(...)

namespace cuda_emulation {

constexpr int kWarpSize = 32;
// What a lane puts in for a warp-collective operation (the largest: an mma's fragments).
constexpr int kLaneWords = 8;

// A barrier of fibers: the last to arrive opens it; the others switch to other fibers until it opens. A thread that
// exits no longer counts, as on the GPU.
struct Barrier {
  explicit Barrier(int expected) : expected(expected) {}
  void arrive_and_wait();
  void drop();
  int expected, arrived = 0;
  uint64_t phase = 0;
};

struct Warp {
  explicit Warp(int lanes) : sync(lanes), lanes(lanes) {}
  Barrier sync;
  int lanes, exited = 0;
  uint32_t words[kWarpSize][kLaneWords];
  const void* addresses[kWarpSize];
};

struct Block {
  Block(dim3 grid_dim, dim3 block_dim, dim3 block_idx, int threads);
  dim3 grid_dim, block_dim, block_idx;
  Barrier sync;
  std::vector<std::unique_ptr<Warp>> warps;
};

struct CopyGroup {
  struct Copy {
    void* shared;
    unsigned char bytes[16];
  };
  std::vector<Copy> copies;
};

struct Thread {
  Block* block = nullptr;
  Warp* warp = nullptr;
  uint3 thread_idx{0, 0, 0};
  int lane = 0;
  CopyGroup open;                   // issued, not yet committed
  std::deque<CopyGroup> committed;  // oldest first
  // Past its wait_for_prior_grid (common.cuh): the accesses it counts before are those a programmatic dependent
  // launch may make while the kernels before it still run (Accesses' before_wait).
  bool waited_for_prior_grid = false;
};

// The running CUDA thread (valid inside a kernel only).
Thread& thread();

// Shared by every thread of the block: 16-byte aligned, NaN bytes when the block starts, the launch's size, then a
// page that no access may touch.
unsigned char* dynamic_shared_memory();
constexpr size_t kMaxDynamicSharedBytes = 227 * 1024;  // an H100's or H200's opt-in limit per block

// A kernel's static __shared__ array (emulation.py rewrites the declaration to call this): NaN bytes at the start of
// every block.
void static_shared_memory(void* array, size_t bytes);

// Fails the running launch (cudaGetLastError returns cudaErrorLaunchFailure, naming `why`); the kernel runs on.
void fail_launch(const char* why);
// Fails the running launch and ends the calling thread, as a trap does.
[[noreturn]] void trap(const char* why);
// Fails the launch when the block has more threads than the kernel's __launch_bounds__ (emulation.py inserts it).
void check_launch_bounds(int max_threads);

inline void check_aligned16(const void* address, const char* what) {
  if (reinterpret_cast<uintptr_t>(address) % 16 != 0) fail_launch(what);
}

inline void check_converged() {
  if (thread().warp->exited > 0) fail_launch("a warp-collective operation after lanes of the warp exited");
}

inline void warp_sync() {
  check_converged();
  thread().warp->sync.arrive_and_wait();
}

// Each lane puts in `mine`; every lane gets `read(words of all lanes)`.
template <typename F>
auto warp_exchange(const uint32_t* mine, int n, F&& read) {
  Thread& self = thread();
  std::memcpy(self.warp->words[self.lane], mine, sizeof(uint32_t) * n);
  warp_sync();
  const auto result = read(*self.warp);
  warp_sync();
  return result;
}

template <typename V>
V shfl_xor(V value, int offset) {
  static_assert(sizeof(V) == 4, "32-bit shuffles only");
  uint32_t word;
  std::memcpy(&word, &value, 4);
  const int lane = thread().lane;
  const uint32_t got = warp_exchange(&word, 1, [&](const Warp& w) {
    const int from = lane ^ offset;
    return from < w.lanes ? w.words[from][0] : w.words[lane][0];
  });
  V out;
  std::memcpy(&out, &got, 4);
  return out;
}

// The two 16-bit halves of a register, as floats (the low half is the lower index).
template <typename T>
inline float half_of(uint32_t word, int high) {
  const uint16_t bits = uint16_t(word >> (16 * high));
  T value;
  std::memcpy(&value, &bits, 2);
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(value);
  } else {
    return __bfloat162float(value);
  }
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D = A B + C (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
// floating point type"). With g = lane / 4 and t = lane % 4: a holds A[g][2t, 2t+1], A[g+8][2t, 2t+1],
// A[g][2t+8, 2t+9], A[g+8][2t+8, 2t+9]; b holds B[2t, 2t+1][g], B[2t+8, 2t+9][g]; c holds C[g][2t, 2t+1],
// C[g+8][2t, 2t+1].
template <typename T>
void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  const int lane = thread().lane, g = lane / 4, t = lane % 4;
  float a_matrix[16][16], b_matrix[16][8];
  warp_exchange(mine, 6, [&](const Warp& w) {
    for (int from = 0; from < kWarpSize; ++from) {
      const int fg = from / 4, ft = from % 4;
      const uint32_t* word = w.words[from];
      for (int i = 0; i < 2; ++i) {
        a_matrix[fg][2 * ft + i] = half_of<T>(word[0], i);
        a_matrix[fg + 8][2 * ft + i] = half_of<T>(word[1], i);
        a_matrix[fg][2 * ft + 8 + i] = half_of<T>(word[2], i);
        a_matrix[fg + 8][2 * ft + 8 + i] = half_of<T>(word[3], i);
        b_matrix[2 * ft + i][fg] = half_of<T>(word[4], i);
        b_matrix[2 * ft + 8 + i][fg] = half_of<T>(word[5], i);
      }
    }
    return 0;
  });
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), column = 2 * t + i % 2;
    float sum = 0.0f;  // products of 16-bit floats are exact in fp32
    for (int k = 0; k < 16; ++k) sum += a_matrix[row][k] * b_matrix[k][column];
    c[i] += sum;
  }
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane i names row i % 8 of matrix i / 8 (eight 16-bit elements);
// register j of lane (g, t) gets elements [g][2t] (low half) and [g][2t+1] of matrix j, or with `transposed`
// [2t][g] and [2t+1][g] (PTX ISA, ldmatrix).
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row, bool transposed) {
  Thread& self = thread();
  check_aligned16(row, "misaligned address: an ldmatrix row not 16-byte aligned");
  self.warp->addresses[self.lane] = row;
  warp_sync();
  const int g = self.lane / 4, t = self.lane % 4;
  for (int j = 0; j < 4; ++j) {
    const auto element = [&](int matrix_row, int column) {
      return uint32_t(static_cast<const uint16_t*>(self.warp->addresses[8 * j + matrix_row])[column]);
    };
    r[j] = transposed ? element(2 * t, g) | element(2 * t + 1, g) << 16
                      : element(g, 2 * t) | element(g, 2 * t + 1) << 16;
  }
  warp_sync();
}

// vote.sync.any: true on every lane when `predicate` holds on any.
inline bool any_lane(bool predicate) {
  const uint32_t word = predicate;
  return warp_exchange(&word, 1, [](const Warp& w) {
    for (int lane = 0; lane < w.lanes; ++lane) {
      if (w.words[lane][0] != 0) return true;
    }
    return false;
  });
}

// Names a buffer of `bytes` at `data` in the byte counts of the kernels this thread launches next
// (macs_kernels/apps/bench/traffic.py; csrc/launch_utils.h's NamedBuffers); nothing unless they are being counted.
void name_buffer(const char* name, const void* data, size_t bytes);
// Ends the name of the buffer at `data` (it is freed).
void forget_buffer(const void* data);

// cp.async.cg.shared.global, 16 bytes (`fill` false: zeros, nothing read), commit_group and wait_group.
void copy16_async(void* shared, const void* global, bool fill);
void copy_async_commit();
void copy_async_wait(int pending);

// A kernel launch: every block of `grid`, one after another, each with one thread per CUDA thread. `dependent`: launched
// as a programmatic dependent of the launch before (macs::launch_kernel), recorded only: grids run one after another.
struct LaunchConfig {
  const void* kernel;
  dim3 grid, block;
  size_t shared_bytes;
  bool dependent;
};
bool launch_refused(const LaunchConfig& config);  // sets the launch error the next cudaGetLastError returns
void run_grid(const LaunchConfig& config, void (*run_thread)(void*), void* call);

template <typename... Params>
struct Launch {
  void (*kernel)(Params...);
  LaunchConfig config;
  template <typename... Args>
  void operator()(Args&&... args) const {
    if (launch_refused(config)) return;
    struct Call {
      void (*kernel)(Params...);
      std::tuple<std::decay_t<Params>...> params;
    } call{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
    run_grid(config, [](void* c) {
      auto* call = static_cast<Call*>(c);
      std::apply(call->kernel, call->params);
    }, &call);
  }
};

template <typename... Params>
Launch<Params...> launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes = 0,
                         cudaStream_t = nullptr, bool dependent = false) {
  return {kernel, LaunchConfig{reinterpret_cast<const void*>(kernel), grid, block, shared_bytes, dependent}};
}

}  // namespace cuda_emulation

#define threadIdx (::cuda_emulation::thread().thread_idx)
#define blockIdx (::cuda_emulation::thread().block->block_idx)
#define blockDim (::cuda_emulation::thread().block->block_dim)
#define gridDim (::cuda_emulation::thread().block->grid_dim)

// cuda_runtime.h's typed overload (nvcc only).
template <typename... Params>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(Params...), cudaFuncAttribute attribute, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attribute, value);
}

inline void __syncthreads() { ::cuda_emulation::thread().block->sync.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::cuda_emulation::warp_sync(); }
template <typename V>
inline V __shfl_xor_sync(unsigned, V value, int offset) { return ::cuda_emulation::shfl_xor(value, offset); }
inline int __any_sync(unsigned, int predicate) { return ::cuda_emulation::any_lane(predicate != 0); }
template <typename V>
inline V __ldg(const V* pointer) { return *pointer; }
inline int __ffs(int x) { return __builtin_ffs(x); }
[[noreturn]] inline void __trap() { ::cuda_emulation::trap("a device-side trap (__trap)"); }

// Device math that CUDA code calls unqualified.
using std::isfinite;
using std::isinf;
using std::isnan;

// The device overloads of min and max that CUDA code calls unqualified.
template <typename A, typename B>
inline auto min(A a, B b) -> std::common_type_t<A, B> { return b < a ? b : a; }
template <typename A, typename B>
inline auto max(A a, B b) -> std::common_type_t<A, B> { return a < b ? b : a; }

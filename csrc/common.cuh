// Torch-free helpers shared by every kernel: constants, element conversion, 16-byte loads, index views,
// reductions.
//
// Everything compiles under torch's extension flags (__CUDA_NO_HALF_OPERATORS__,
// __CUDA_NO_HALF_CONVERSIONS__, __CUDA_NO_BFLOAT16_CONVERSIONS__): conversions are explicit calls.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace macs {

// Same order as the schema's strings "max", "mean", "min" (see launch_utils.h).
enum class Pooling : int { kMax = 0, kMean = 1, kMin = 2 };

// The -inf convention: a masked score, the max of no score and the log-sum-exp of an empty row are kNegInf;
// an exponential of a difference with kNegInf on its left is taken as 0 without evaluating it, so that
// exp(-inf - (-inf)) never makes a NaN.
constexpr float kInf = __builtin_huge_valf();
constexpr float kNegInf = -kInf;

// Scores are carried as score * log2(e), so that each exponential is one exp2 (split_kv/state.cuh).
constexpr float kLog2e = 1.4426950408889634f;

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Elements per 16-byte load of T.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

// Loads VEC consecutive elements as floats: one 16-byte transaction when VEC * sizeof(T) == 16 (the
// launcher guarantees the alignment then), element by element when VEC == 1.
template <typename T, int VEC>
__device__ __forceinline__ void load_floats(const T* __restrict__ src, float (&dst)[VEC]) {
  if constexpr (VEC * sizeof(T) == 16) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
    const T* elements = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) dst[i] = to_float(elements[i]);
  } else {
    static_assert(VEC == 1, "VEC is either one element or 16 bytes");
    dst[0] = to_float(src[0]);
  }
}

// An int32 or int64 index tensor, (B,) or (B, R) (query row r of item b); a stride is 0 where a value is
// broadcast, and stride_r is 0 for a (B,) tensor, so that every row of item b reads its value. Both widths are
// read as they are (FlashAttention's and vLLM's lengths are int32): converting would cost the caller a launch.
struct Index {
  const void* data;
  int64_t stride_b, stride_r;
  bool is_int32 = false;
  __device__ __forceinline__ int64_t operator()(int64_t b, int64_t r = 0) const {
    const int64_t at = b * stride_b + r * stride_r;
    return is_int32 ? int64_t(static_cast<const int32_t*>(data)[at]) : static_cast<const int64_t*>(data)[at];
  }
};

// Key range [start, input_end, end) of query row r of item b, clamped into [0, keys]: the public ops
// validate the values, and clamping keeps a direct torch.ops call with bad indices from reading out of
// bounds.
struct KeyRange {
  int64_t start, input_end, end;
  __device__ __forceinline__ KeyRange(const Index& start_, const Index& input_end_, const Index& end_, int64_t b,
                                      int64_t r, int64_t keys) {
    end = min(max(end_(b, r), int64_t(0)), keys);
    start = min(max(start_(b, r), int64_t(0)), end);
    input_end = min(max(input_end_(b, r), start), end);
  }
};

// n / divisor for every 32-bit n by a multiply-high, two adds and two shifts (Granlund and Montgomery, PLDI 1994;
// FlashInfer's uint_fastdiv), for the divisors key loops meet at run time: a block's query rows (a vector's head and
// row) and a paged cache's page size (a key's page). A 32-bit division is about 20 instructions, and the stores of the
// fused pass's scores and every 16-byte copy of a paged tile did one. With l = ceil(log2 divisor) and multiplier =
// floor(2^32 (2^l - divisor) / divisor) + 1: t = n * multiplier / 2^32 and n / divisor = (t + (n - t) >> min(l, 1)) >>
// max(l - 1, 0). 1 <= divisor < 2^31.
struct FastDivisor {
  uint32_t divisor, multiplier, shift_1, shift_2;
  __host__ __device__ FastDivisor() : FastDivisor(1u) {}
  __host__ __device__ explicit FastDivisor(uint32_t d) : divisor(d) {
    uint32_t l = 0;
    while ((uint64_t(1) << l) < d) ++l;
    multiplier = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << l) - d)) / d + 1);
    shift_1 = l < 1 ? l : 1;
    shift_2 = l > 1 ? l - 1 : 0;
  }
  __host__ __device__ __forceinline__ uint32_t quotient(uint32_t n) const {
    const uint32_t t = uint32_t((uint64_t(n) * multiplier) >> 32);
    return (t + ((n - t) >> shift_1)) >> shift_2;
  }
};

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Block-wide sum or max; every thread gets the result. `scratch` holds 32 floats; blockDim.x is a
// multiple of 32.
template <bool IS_MAX>
__device__ float block_reduce(float x, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  x = IS_MAX ? warp_max(x) : warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < warps ? scratch[lane] : (IS_MAX ? kNegInf : 0.0f);
  return IS_MAX ? warp_max(x) : warp_sum(x);
}

// Programmatic dependent launch (sm_90 and later): a kernel launched as the dependent of the one before it on its
// stream (launch_kernel's `dependent`) may start while that one's last blocks run; it must call wait_for_prior_grid
// before its first read of anything the kernel before wrote (the wait returns once that kernel has ended and its writes
// are visible; without a dependent launch it returns at once). release_dependent_grid lets the next kernel's blocks be
// placed once every block of this one has passed it (they then wait: it grants no early read). Both compile to
// nothing below sm_90. The CPU emulation runs grids one after another; there the wait marks the thread's later
// accesses, so that a test can find an access a dependent makes before it to memory the kernels before it write
// (emulation.dependent_launch_hazards).
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(MACS_CPU_EMULATION)
  ::cuda_emulation::thread().waited_for_prior_grid = true;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void release_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether the split pass launches its combine and head pooling as programmatic dependents: MACS_KERNELS_CUDA_PDL=1,
// read when the library loads, or macs_kernels_set_dependent_launches (csrc/bindings.cpp; process-wide; off by
// default until a GPU times it).
bool dependent_launches();
// Counts a launch made as a programmatic dependent (macs_kernels_dependent_launches_made: a GPU test checks that its
// dependent cases made some).
void count_dependent_launch();
// Whether `kernel`, as loaded for the current device, waits in wait_for_prior_grid: its code was compiled for
// compute_90 or later (a build whose newest target is older, run through the driver's PTX compiler, does not wait,
// and a dependent launch of it would read its inputs early).
bool waits_for_prior_grid(const void* kernel);

// Lets `kernel`, on the current device, launch with `bytes` of dynamic shared memory (above 48 KiB a kernel must be
// granted it). The grant is the kernel's, per device, whoever launches it: it only grows (a thread that set a smaller
// one between another's grant and launch would fail that launch), and a size granted already costs no runtime call,
// where cudaFuncSetAttribute on every launch cost the host a driver call each time (it waits for the device's pending
// copies, too).
cudaError_t allow_dynamic_shared(const void* kernel, size_t bytes);

template <typename... Params>
cudaError_t allow_dynamic_shared(void (*kernel)(Params...), size_t bytes) {
  return allow_dynamic_shared(reinterpret_cast<const void*>(kernel), bytes);
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), as a programmatic dependent of the kernel before it when
// `dependent` and the kernel waits for it (waits_for_prior_grid).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(bool dependent, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                          cudaStream_t stream, Args... args) {
#ifdef MACS_CPU_EMULATION
  ::cuda_emulation::launch(kernel, grid, block, shared_bytes, stream, dependent)(args...);
#else
  if (dependent && waits_for_prior_grid(reinterpret_cast<const void*>(kernel))) {
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = shared_bytes;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    cudaLaunchKernelEx(&config, kernel, args...);
    count_dependent_launch();
    return cudaGetLastError();  // and clears it, as after a plain launch
  }
  kernel<<<grid, block, shared_bytes, stream>>>(args...);
#endif
  return cudaGetLastError();
}

}  // namespace macs

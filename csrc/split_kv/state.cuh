// The partial softmax state of the split-KV pass (like FlashInfer's state.cuh): scores are carried in
// base 2, x = score * log2(e), so every exponential is one exp2; the log-sum-exp leaves in natural log.
#pragma once

#include <cfloat>

#include "common.cuh"

namespace macs {

// 2^(x - m), and 0 when x is -inf (then m may be -inf too: no NaN from -inf - -inf).
__device__ __forceinline__ float exp2_diff(float x, float m) { return x == kNegInf ? 0.0f : exp2f(x - m); }

// 2^x by the SFU alone (ex2.approx.ftz, as FlashAttention's and FlashInfer's softmax): exp2f adds four instructions
// a call to keep results below 2^-126 as subnormals, which this flushes to 0.
__device__ __forceinline__ float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  const float y = exp2f(x);
  return y < FLT_MIN ? 0.0f : y;
#endif
}

// exp2_diff for a term of a sum that holds a term 1 (m is the largest x summed, or a running max that the largest
// becomes): a term below 2^-126 of it is no part of any float32 result, so fast_exp2 serves. Not for a result that
// is itself a probability or a sum of small terms (head pooling, the generated keys' share of a row).
__device__ __forceinline__ float exp2_weight(float x, float m) { return x == kNegInf ? 0.0f : fast_exp2(x - m); }

// Sum of 2^x over the merged base-2 scores x, held as l * 2^m; m = -inf and l = 0 when empty.
struct SoftmaxState {
  float m = kNegInf, l = 0.0f;

  __device__ __forceinline__ void merge(float other_m, float other_l) {
    const float top = fmaxf(m, other_m);
    if (top == kNegInf) return;
    l = l * exp2_weight(m, top) + other_l * exp2_weight(other_m, top);
    m = top;
  }
  // Every lane of a warp ends with the merge of the warp's 32 states.
  __device__ __forceinline__ void merge_warp() {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other_m = __shfl_xor_sync(0xffffffffu, m, offset), other_l = __shfl_xor_sync(0xffffffffu, l, offset);
      merge(other_m, other_l);
    }
  }
  __device__ __forceinline__ float lse2() const { return l > 0.0f ? m + log2f(l) : kNegInf; }
  // Natural-log log-sum-exp of the unscaled scores.
  __device__ __forceinline__ float lse() const { return lse2() / kLog2e; }
};

}  // namespace macs

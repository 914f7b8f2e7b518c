// The partial softmax state of the split-KV pass (like FlashInfer's state.cuh): scores are carried in
// base 2, x = score * log2(e), so every exponential is one exp2; the log-sum-exp leaves in natural log.
#pragma once

#include "common.cuh"

namespace macs {

// 2^x by the SFU alone (ex2.approx.ftz, as FlashAttention's and FlashInfer's softmax): exp2f adds four instructions
// a call for results below 2^-126, which it keeps as subnormals and this flushes to 0. Every exponent here is a score
// less the largest it is summed with, whose own term is 1, so no sum can tell the difference.
__device__ __forceinline__ float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  const float y = exp2f(x);
  return y < 1.17549435e-38f ? 0.0f : y;
#endif
}

// 2^(x - m), and 0 when x is -inf (then m may be -inf too: no NaN from -inf - -inf).
__device__ __forceinline__ float exp2_diff(float x, float m) { return x == kNegInf ? 0.0f : fast_exp2(x - m); }

// Sum of 2^x over the merged base-2 scores x, held as l * 2^m; m = -inf and l = 0 when empty.
struct SoftmaxState {
  float m = kNegInf, l = 0.0f;

  __device__ __forceinline__ void merge(float other_m, float other_l) {
    const float top = fmaxf(m, other_m);
    if (top == kNegInf) return;
    l = l * exp2_diff(m, top) + other_l * exp2_diff(other_m, top);
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

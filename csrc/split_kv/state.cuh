// The partial softmax state of the split-KV pass (like FlashInfer's state.cuh): scores are carried in
// base 2, x = score * log2(e), so every exponential is one exp2f; the log-sum-exp leaves in natural log.
#pragma once

#include "common.cuh"

namespace macs {

// 2^(x - m), and 0 when x is -inf (then m may be -inf too: no NaN from -inf - -inf).
__device__ __forceinline__ float exp2_diff(float x, float m) { return x == kNegInf ? 0.0f : exp2f(x - m); }

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

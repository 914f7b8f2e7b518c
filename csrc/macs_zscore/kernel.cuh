// z-scores of c = exp(log_c) over each row's first n_input[b] entries: one block per row, three
// passes (max, mean, variance about the mean) so the variance does not cancel in float32.
#pragma once

#include "common.cuh"

namespace macs {

struct ZscoreParams {
  const float* log_c;  // (B, N_max), contiguous
  Index n_input;
  float* z;  // (B, N_max), contiguous
  int64_t batch, n_max;
};

// A template, so that launch.cu, which includes this header for ZscoreParams, compiles no kernel.
template <int THREADS>
__global__ void __launch_bounds__(THREADS) zscore_kernel(ZscoreParams p) {
  __shared__ float scratch[32];
  const int64_t b = blockIdx.x;
  const int64_t n = min(max(p.n_input(b), int64_t(0)), p.n_max);
  const float* row = p.log_c + b * p.n_max;

  float top = kNegInf;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) top = fmaxf(top, row[i]);
  top = block_reduce<true>(top, scratch);
  // z does not change when c is scaled; a row of -inf (all attention underflowed) has no finite top.
  if (!isfinite(top)) top = 0.0f;

  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += expf(row[i] - top);
  const float count = float(max(n, int64_t(1)));
  const float mean = block_reduce<false>(sum, scratch) / count;

  float squares = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float centred = expf(row[i] - top) - mean;
    squares += centred * centred;
  }
  const float std = sqrtf(block_reduce<false>(squares, scratch) / count);

  for (int64_t i = threadIdx.x; i < p.n_max; i += blockDim.x) {
    p.z[b * p.n_max + i] = i < n && std > 0.0f ? (expf(row[i] - top) - mean) / std : 0.0f;
  }
}

// Not a template: log_c is float32 whatever the model's dtype.
cudaError_t macs_zscore(const ZscoreParams& p, cudaStream_t stream);

}  // namespace macs

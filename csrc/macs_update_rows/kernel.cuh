// MACS layer term from attention rows, and the head-pooling kernel every MACS op ends with.
//
// Pooling needs all H heads of a key, so it runs after the rows (or the scores and their per-head
// log-sum-exp) are complete: one thread per input key loops over the heads; consecutive threads read
// consecutive keys of a head's row.
#pragma once

#include "common.cuh"

namespace macs {

template <typename Src>
struct PoolParams {
  const Src* values;  // rows (B, H, S), or float32 scaled scores when FROM_SCORES
  int64_t stride_b, stride_h;
  // (B, H, 2) per head: the log-sum-exp that normalises its scores (unused for rows) and its attention
  // mass on generated keys (0 without redistribution).
  const float* stats;
  float* log_c;        // (B, N_max), contiguous
  int64_t n_max, heads, keys;
  Index start, input_end, end;
  float alpha;
  Pooling pooling;
};

constexpr int kPoolThreads = 256;

template <typename Src, bool FROM_SCORES>
__global__ void __launch_bounds__(kPoolThreads) pool_kernel(PoolParams<Src> p) {
  extern __shared__ float stats[];
  const int64_t b = blockIdx.y;
  for (int64_t i = threadIdx.x; i < 2 * p.heads; i += blockDim.x) stats[i] = p.stats[b * 2 * p.heads + i];
  __syncthreads();

  const KeyRange range(p.start, p.input_end, p.end, b, p.keys);
  const int64_t n_input = range.input_end - range.start;
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= min(n_input, p.n_max)) return;

  const Src* column = p.values + b * p.stride_b + range.start + i;
  float pooled = p.pooling == Pooling::kMax ? kNegInf : (p.pooling == Pooling::kMin ? -kNegInf : 0.0f);
  for (int64_t h = 0; h < p.heads; ++h) {
    float value = to_float(column[h * p.stride_h]);
    if (FROM_SCORES) value = expf(value - stats[2 * h]);
    value += stats[2 * h + 1] / float(n_input);
    pooled = p.pooling == Pooling::kMax ? fmaxf(pooled, value)
             : p.pooling == Pooling::kMin ? fminf(pooled, value)
                                          : pooled + value;
  }
  if (p.pooling == Pooling::kMean) pooled /= float(p.heads);
  // Efficient-attention rows can pool below zero; clamping keeps the floor's log defined.
  p.log_c[b * p.n_max + i] += logf(p.alpha * fmaxf(pooled, 0.0f) + (1.0f - p.alpha));
}

template <typename Src, bool FROM_SCORES>
cudaError_t launch_pool(const PoolParams<Src>& p, int64_t batch, cudaStream_t stream) {
  const dim3 grid(unsigned(ceil_div(p.n_max, kPoolThreads)), unsigned(batch));
  pool_kernel<Src, FROM_SCORES><<<grid, kPoolThreads, 2 * p.heads * sizeof(float), stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
struct RowsParams {
  const T* rows;  // (B, H, S)
  int64_t stride_b, stride_h;
  int64_t batch, heads, keys;
  float* log_c;  // (B, N_max), contiguous
  int64_t n_max;
  Index input_start, input_end, kv_len;
  float alpha;
  Pooling pooling;
  bool redistribute;
  float* stats;  // scratch (B, H, 2)
};

constexpr int kMassThreads = 256;

// Attention mass of row (b, h) on the generated keys [input_end, kv_len).
template <typename T>
__global__ void __launch_bounds__(kMassThreads) generated_mass_kernel(RowsParams<T> p) {
  __shared__ float scratch[32];
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const KeyRange range(p.input_start, p.input_end, p.kv_len, b, p.keys);
  const T* row = p.rows + b * p.stride_b + h * p.stride_h;
  float mass = 0.0f;
  if (p.redistribute) {
    for (int64_t j = range.input_end + threadIdx.x; j < range.end; j += blockDim.x) mass += to_float(row[j]);
  }
  mass = block_reduce<false>(mass, scratch);
  if (threadIdx.x == 0) {
    p.stats[(b * p.heads + h) * 2] = 0.0f;
    p.stats[(b * p.heads + h) * 2 + 1] = mass;
  }
}

template <typename T>
cudaError_t macs_update_rows(const RowsParams<T>& p, cudaStream_t stream) {
  generated_mass_kernel<T><<<dim3(unsigned(p.heads), unsigned(p.batch)), kMassThreads, 0, stream>>>(p);
  const PoolParams<T> pool{p.rows,      p.stride_b,  p.stride_h, p.stats,        p.log_c,
                           p.n_max,     p.heads,     p.keys,     p.input_start, p.input_end,
                           p.kv_len,    p.alpha,     p.pooling};
  const cudaError_t error = cudaGetLastError();
  return error != cudaSuccess ? error : launch_pool<T, false>(pool, p.batch, stream);
}

extern template cudaError_t macs_update_rows<float>(const RowsParams<float>&, cudaStream_t);
extern template cudaError_t macs_update_rows<__half>(const RowsParams<__half>&, cudaStream_t);
extern template cudaError_t macs_update_rows<__nv_bfloat16>(const RowsParams<__nv_bfloat16>&, cudaStream_t);

}  // namespace macs

// MACS layer update from given attention rows (efficient attention, other tools): each row's mass on its
// generated keys, then head pooling (pool/kernel.cuh) into log_c.
#pragma once

#include "pool/kernel.cuh"

namespace macs {

template <typename T>
struct RowsParams {
  const T* rows;  // (B, H, S)
  int64_t stride_b, stride_h;
  int64_t batch, heads, keys;
  float* log_c;  // (B, N_max), contiguous
  int64_t n_max;
  Index input_start, input_end, kv_len;  // (B,)
  float alpha;
  Pooling pooling;
  bool redistribute;
  float* stats;  // scratch (B, H, 2)
  int64_t sm_count;  // the GPU's multiprocessors (head pooling's pool_head_slices)
};

constexpr int kMassThreads = 256;

// Attention mass of row (b, h) on the generated keys [input_end, kv_len), as head pooling's stats.
template <typename T>
__global__ void __launch_bounds__(kMassThreads) generated_mass_kernel(RowsParams<T> p) {
  __shared__ float scratch[32];
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const KeyRange range(p.input_start, p.input_end, p.kv_len, b, 0, p.keys);
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

// Both kernels on `stream` (defined and instantiated in kernel.cu).
template <typename T>
cudaError_t macs_update_rows(const RowsParams<T>& p, cudaStream_t stream);

}  // namespace macs

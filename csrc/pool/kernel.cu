// Torch-free definitions and instantiations (plain nvcc compiles this file alone): pooling of attention
// rows in every supported dtype, pooling of a split-KV pass's float32 scores, and that composition.
#include "pool/kernel.cuh"

namespace macs {

template <typename Src, bool FROM_SCORES>
cudaError_t pool_heads(const PoolParams<Src>& p, int64_t batch, cudaStream_t stream) {
  const dim3 grid(unsigned(ceil_div(p.n_max, kPoolThreads)), unsigned(p.rows), unsigned(batch));
  pool_kernel<Src, FROM_SCORES><<<grid, kPoolThreads, 2 * p.heads * sizeof(float), stream>>>(p);
  return cudaGetLastError();
}

template <typename T, bool WITH_V>
cudaError_t split_kv_pool(const SplitParams<T>& p, const CombineParams<T>& combine, const PoolTail& tail,
                          SplitKernel kernel, bool vectorized, cudaStream_t stream) {
  const cudaError_t error = split_kv<T, WITH_V>(p, combine, kernel, vectorized, stream);
  if (error != cudaSuccess || tail.out == nullptr) return error;
  const PoolParams<float> pool{p.scores,   p.heads * p.rows * p.keys, p.rows * p.keys, p.keys,
                               tail.stats, tail.out,  tail.n_max,     p.heads,         p.rows,
                               p.keys,     p.start,   p.input_end,    p.end,           tail.alpha,
                               tail.pooling, tail.epilogue, tail.score_start};
  return pool_heads<float, true>(pool, p.batch, stream);
}

template cudaError_t pool_heads<float, true>(const PoolParams<float>&, int64_t, cudaStream_t);
#define MACS_INSTANTIATE_POOL(T)                                                                       \
  template cudaError_t pool_heads<T, false>(const PoolParams<T>&, int64_t, cudaStream_t);              \
  template cudaError_t split_kv_pool<T, false>(const SplitParams<T>&, const CombineParams<T>&,         \
                                               const PoolTail&, SplitKernel, bool, cudaStream_t);      \
  template cudaError_t split_kv_pool<T, true>(const SplitParams<T>&, const CombineParams<T>&,          \
                                              const PoolTail&, SplitKernel, bool, cudaStream_t);
MACS_INSTANTIATE_POOL(float)
MACS_INSTANTIATE_POOL(__half)
MACS_INSTANTIATE_POOL(__nv_bfloat16)
#undef MACS_INSTANTIATE_POOL

}  // namespace macs

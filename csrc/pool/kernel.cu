// Torch-free definitions and instantiations (plain nvcc compiles this file alone): pooling of attention
// rows in every supported dtype, pooling of a split-KV pass's scores (float32, or fp16 relative), and that
// composition.
#include "pool/kernel.cuh"

namespace macs {

template <typename Src, bool FROM_SCORES>
cudaError_t pool_heads(const PoolParams<Src>& p, int64_t batch, int64_t sm_count, cudaStream_t stream,
                       bool dependent) {
  const int slices = pool_head_slices(p.n_max * p.rows * batch, p.heads, sm_count);
  const dim3 grid(unsigned(ceil_div(p.n_max * slices, kPoolThreads)), unsigned(p.rows), unsigned(batch));
  const size_t shared = (2 * p.heads + (slices > 1 ? kPoolThreads : 0)) * sizeof(float);
  switch (slices) {
    case 1:
      return launch_kernel(dependent, pool_kernel<Src, FROM_SCORES, 1>, grid, dim3(kPoolThreads), shared, stream, p);
    case 2:
      return launch_kernel(dependent, pool_kernel<Src, FROM_SCORES, 2>, grid, dim3(kPoolThreads), shared, stream, p);
    case kPoolMaxHeadSlices:
      return launch_kernel(dependent, pool_kernel<Src, FROM_SCORES, kPoolMaxHeadSlices>, grid, dim3(kPoolThreads),
                           shared, stream, p);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T, bool WITH_V>
cudaError_t split_kv_pool(const SplitParams<T>& p, const CombineParams<T>& combine, const PoolTail& tail,
                          SplitKernel kernel, bool vectorized, cudaStream_t stream) {
  const cudaError_t error = split_kv<T, WITH_V>(p, combine, kernel, vectorized, stream);
  if (error != cudaSuccess || tail.out == nullptr) return error;
  const auto pool = [&](const auto* scores, int64_t stride, const float* maxima) {
    using Score = std::remove_const_t<std::remove_pointer_t<decltype(scores)>>;
    const PoolParams<Score> params{scores,       p.heads * p.rows * stride, p.rows * stride, stride,
                                   tail.stats,   tail.out,                  tail.n_max,      p.heads,
                                   p.rows,       p.keys,                    p.start,         p.input_end,
                                   p.end,        tail.alpha,                tail.pooling,    tail.epilogue,
                                   tail.score_start, maxima};
    // Right after the combine, which wrote the stats it reads: its programmatic dependent when those launch so.
    return pool_heads<Score, true>(params, p.batch, tail.sm_count, stream, dependent_launches());
  };
  return p.relative_scores != nullptr ? pool(p.relative_scores, relative_score_stride(p.keys), p.score_maxima)
                                      : pool(p.scores, p.keys, nullptr);
}

template cudaError_t pool_heads<float, true>(const PoolParams<float>&, int64_t, int64_t, cudaStream_t, bool);
template cudaError_t pool_heads<__half, true>(const PoolParams<__half>&, int64_t, int64_t, cudaStream_t, bool);
#define MACS_INSTANTIATE_POOL(T)                                                                       \
  template cudaError_t pool_heads<T, false>(const PoolParams<T>&, int64_t, int64_t, cudaStream_t, bool); \
  template cudaError_t split_kv_pool<T, false>(const SplitParams<T>&, const CombineParams<T>&,         \
                                               const PoolTail&, SplitKernel, bool, cudaStream_t);      \
  template cudaError_t split_kv_pool<T, true>(const SplitParams<T>&, const CombineParams<T>&,          \
                                              const PoolTail&, SplitKernel, bool, cudaStream_t);
MACS_INSTANTIATE_POOL(float)
MACS_INSTANTIATE_POOL(__half)
MACS_INSTANTIATE_POOL(__nv_bfloat16)
#undef MACS_INSTANTIATE_POOL

}  // namespace macs

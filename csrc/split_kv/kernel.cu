// Torch-free definition and instantiations for every supported dtype, with and without V (plain nvcc
// compiles this file alone). The only copy of split_kernel and combine_kernel; pipelined_split_kernel and
// mma_split_kernel have their own pieces (split_kv_pipelined/kernel.cu, split_kv_mma/kernel.cu).
#include "split_kv_mma/kernel.cuh"

namespace macs {
namespace {

template <typename T, bool WITH_V>
cudaError_t launch_split_kernel(const SplitParams<T>& p, bool vectorized, cudaStream_t stream) {
  const int64_t group = p.heads / p.kv_heads;
  const size_t smem = split_smem_bytes(group, p.rows_per_block, p.dim, p.dim_v, WITH_V);
  const int threads = split_threads(group * p.rows_per_block, WITH_V ? p.dim_v : 0);
  const dim3 grid(unsigned(p.splits), unsigned(p.kv_heads * ceil_div(p.rows, p.rows_per_block)), unsigned(p.batch));
  // The softcap is a compile-time flag: the plain path keeps its one multiply per score.
  const bool capped = p.cap_out != 0.0f;
  const auto kernel = vectorized ? (capped ? split_kernel<T, kVec16<T>, WITH_V, true>
                                           : split_kernel<T, kVec16<T>, WITH_V, false>)
                                 : (capped ? split_kernel<T, 1, WITH_V, true> : split_kernel<T, 1, WITH_V, false>);
  const cudaError_t error = allow_dynamic_shared(kernel, smem);
  if (error != cudaSuccess) return error;
  kernel<<<grid, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

template <typename T, bool WITH_V>
cudaError_t split_kv(const SplitParams<T>& p, const CombineParams<T>& combine, SplitKernel kernel, bool vectorized,
                     cudaStream_t stream) {
  cudaError_t error = cudaErrorInvalidValue;  // every kernel is one of the three
  if constexpr (sizeof(T) == 2) {  // mma_split exists for fp16 and bf16 only (mma_fits)
    if (kernel == SplitKernel::kMma) error = mma_split<T, WITH_V>(p, stream);
  }
  if (kernel == SplitKernel::kPipelined) error = pipelined_split<T, WITH_V>(p, stream);
  if (kernel == SplitKernel::kGeneral) error = launch_split_kernel<T, WITH_V>(p, vectorized, stream);
  if (error != cudaSuccess) return error;
  const dim3 combine_grid(unsigned(combine.rows_per_item), unsigned(p.batch));
  const auto combine_pass = combine_columns(combine.dim_v) == 4 ? combine_kernel<T, 4> : combine_kernel<T, 1>;
  return launch_kernel(dependent_launches(), combine_pass, combine_grid, dim3(kCombineThreads),
                       combine_smem_bytes(p.splits), stream, combine);
}

#define MACS_INSTANTIATE_SPLIT_KV(T)                                                                                 \
  template cudaError_t split_kv<T, false>(const SplitParams<T>&, const CombineParams<T>&, SplitKernel, bool, \
                                          cudaStream_t);                                                     \
  template cudaError_t split_kv<T, true>(const SplitParams<T>&, const CombineParams<T>&, SplitKernel, bool,  \
                                         cudaStream_t);
MACS_INSTANTIATE_SPLIT_KV(float)
MACS_INSTANTIATE_SPLIT_KV(__half)
MACS_INSTANTIATE_SPLIT_KV(__nv_bfloat16)
#undef MACS_INSTANTIATE_SPLIT_KV

}  // namespace macs

// Torch-free definition and instantiations of the tensor-core split kernel for fp16 and bf16, with and without V
// (plain nvcc compiles this file alone). The combine pass is split_kv/kernel.cu's.
#include "split_kv_mma/kernel.cuh"

namespace macs {

template <typename T, bool WITH_V>
cudaError_t mma_split(const SplitParams<T>& p, cudaStream_t stream) {
  const size_t smem = mma_smem_bytes(p.rows_per_block, p.dim, WITH_V);
  const dim3 grid(unsigned(p.splits), unsigned(p.kv_heads * ceil_div(p.rows, p.rows_per_block)), unsigned(p.batch));
  const auto kernel = p.dim == 64 ? mma_split_kernel<T, 64, WITH_V> : mma_split_kernel<T, 128, WITH_V>;
  const cudaError_t error = allow_dynamic_shared(kernel, smem);
  if (error != cudaSuccess) return error;
  kernel<<<grid, kMmaThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

#define MACS_INSTANTIATE_MMA_SPLIT(T)                                                  \
  template cudaError_t mma_split<T, false>(const SplitParams<T>&, cudaStream_t); \
  template cudaError_t mma_split<T, true>(const SplitParams<T>&, cudaStream_t);
MACS_INSTANTIATE_MMA_SPLIT(__half)
MACS_INSTANTIATE_MMA_SPLIT(__nv_bfloat16)
#undef MACS_INSTANTIATE_MMA_SPLIT

}  // namespace macs

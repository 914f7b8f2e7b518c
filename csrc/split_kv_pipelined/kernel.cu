// Torch-free definition and instantiations of the pipelined split kernel for every supported dtype, with and
// without V (plain nvcc compiles this file alone). The combine pass is split_kv/kernel.cu's.
#include "split_kv_pipelined/kernel.cuh"

namespace macs {

template <typename T, bool WITH_V>
cudaError_t pipelined_split(const SplitParams<T>& p, cudaStream_t stream) {
  const int64_t group = p.heads / p.kv_heads, block_rows = p.rows_per_block;
  const int64_t lanes = pipelined_lanes(p.dim, sizeof(T));
  const size_t smem = pipelined_smem_bytes(group * block_rows, block_rows, p.tile_keys, p.key_groups, p.dim, p.dim_v,
                                           WITH_V, sizeof(T));
  const int threads = pipelined_threads(group * block_rows, lanes, p.key_groups);
  const dim3 grid(unsigned(p.splits), unsigned(p.kv_heads * ceil_div(p.rows, block_rows)), unsigned(p.batch));
  const auto kernel = pipelined_split_kernel<T, WITH_V>;
  const cudaError_t error = allow_dynamic_shared(kernel, smem);
  if (error != cudaSuccess) return error;
  kernel<<<grid, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

#define MACS_INSTANTIATE_PIPELINED_SPLIT(T)                                   \
  template cudaError_t pipelined_split<T, false>(const SplitParams<T>&, cudaStream_t); \
  template cudaError_t pipelined_split<T, true>(const SplitParams<T>&, cudaStream_t);
MACS_INSTANTIATE_PIPELINED_SPLIT(float)
MACS_INSTANTIATE_PIPELINED_SPLIT(__half)
MACS_INSTANTIATE_PIPELINED_SPLIT(__nv_bfloat16)
#undef MACS_INSTANTIATE_PIPELINED_SPLIT

}  // namespace macs

// Torch-free definition and instantiations for every supported dtype (plain nvcc compiles this file alone).
#include "macs_update_rows/kernel.cuh"

namespace macs {

template <typename T>
cudaError_t macs_update_rows(const RowsParams<T>& p, cudaStream_t stream) {
  generated_mass_kernel<T><<<dim3(unsigned(p.heads), unsigned(p.batch)), kMassThreads, 0, stream>>>(p);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  const PoolParams<T> pool{p.rows,    p.stride_b,    p.stride_h,  0,        p.stats,
                           p.log_c,   p.n_max,       p.heads,     1,        p.keys,
                           p.input_start, p.input_end, p.kv_len,  p.alpha,  p.pooling,
                           PoolEpilogue::kAddLogFloor};
  return pool_heads<T, false>(pool, p.batch, p.sm_count, stream);
}

template cudaError_t macs_update_rows<float>(const RowsParams<float>&, cudaStream_t);
template cudaError_t macs_update_rows<__half>(const RowsParams<__half>&, cudaStream_t);
template cudaError_t macs_update_rows<__nv_bfloat16>(const RowsParams<__nv_bfloat16>&, cudaStream_t);

}  // namespace macs

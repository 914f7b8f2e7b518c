// Torch-free definition (plain nvcc compiles this file alone); log_c is always float32.
#include "macs_zscore/kernel.cuh"

namespace macs {
cudaError_t macs_zscore(const ZscoreParams& p, cudaStream_t stream) {
  zscore_kernel<512><<<unsigned(p.batch), 512, 0, stream>>>(p);
  return cudaGetLastError();
}
}  // namespace macs

// Torch-free definition and instantiations for every supported dtype (plain nvcc compiles this file alone).
#include "attention_features/kernel.cuh"

namespace macs {

template <typename T>
cudaError_t attention_features(const FeaturesParams<T>& p, bool compute_lse, cudaStream_t stream) {
  const dim3 block(kFeatureWarps * 32);
  if (compute_lse) {
    const dim3 grid(unsigned(p.batch * p.heads), unsigned(ceil_div(p.rows, kFeatureWarps)));
    features_lse_kernel<T><<<grid, block, 0, stream>>>(p);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  const dim3 grid(unsigned(p.batch * p.heads), unsigned(ceil_div(p.n_max, kFeatureTile)));
  features_kernel<T><<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

#define MACS_INSTANTIATE_FEATURES(T) \
  template cudaError_t attention_features<T>(const FeaturesParams<T>&, bool, cudaStream_t);
MACS_INSTANTIATE_FEATURES(float)
MACS_INSTANTIATE_FEATURES(__half)
MACS_INSTANTIATE_FEATURES(__nv_bfloat16)
#undef MACS_INSTANTIATE_FEATURES

}  // namespace macs

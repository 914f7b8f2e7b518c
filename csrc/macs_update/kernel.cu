// Torch-free instantiations for every supported dtype (plain nvcc compiles this file alone).
#include "macs_update/kernel.cuh"

namespace macs {
#define MACS_INSTANTIATE_UPDATE(T)                                                        \
  template cudaError_t macs_update<T>(const SplitParams<T>&, const CombineParams<T>&, \
                                      const PoolTail&, bool, cudaStream_t);
MACS_INSTANTIATE_UPDATE(float)
MACS_INSTANTIATE_UPDATE(__half)
MACS_INSTANTIATE_UPDATE(__nv_bfloat16)
#undef MACS_INSTANTIATE_UPDATE
}  // namespace macs

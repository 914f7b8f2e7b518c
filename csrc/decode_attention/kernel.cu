// Torch-free instantiations for every supported dtype (plain nvcc compiles this file alone).
#include "decode_attention/kernel.cuh"

namespace macs {
#define MACS_INSTANTIATE_DECODE(T)                                                             \
  template cudaError_t decode_attention<T>(const SplitParams<T>&, const CombineParams<T>&, \
                                           const PoolTail&, bool, cudaStream_t);
MACS_INSTANTIATE_DECODE(float)
MACS_INSTANTIATE_DECODE(__half)
MACS_INSTANTIATE_DECODE(__nv_bfloat16)
#undef MACS_INSTANTIATE_DECODE
}  // namespace macs

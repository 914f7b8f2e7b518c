// MACS layer update from q and K: decode attention's split and combine passes without V, then pooling.
//
// The split pass reads each key once for the G query heads of its KV head and writes the float32
// scores; the combine pass gives each head its normalising lse (the given one, or the one it computed in
// that same pass) and its generated mass; pooling reads the scores, which all H heads need per key.
#pragma once

#include "decode_attention/kernel.cuh"

namespace macs {

template <typename T>
cudaError_t macs_update(const SplitParams<T>& p, const CombineParams<T>& combine, const PoolTail& tail,
                        bool vectorized, cudaStream_t stream) {
  return split_combine_pool<T, false>(p, combine, tail, vectorized, stream);
}

#define MACS_DECLARE_UPDATE(T)                                                                   \
  extern template cudaError_t macs_update<T>(const SplitParams<T>&, const CombineParams<T>&, \
                                             const PoolTail&, bool, cudaStream_t);
MACS_DECLARE_UPDATE(float)
MACS_DECLARE_UPDATE(__half)
MACS_DECLARE_UPDATE(__nv_bfloat16)
#undef MACS_DECLARE_UPDATE

}  // namespace macs

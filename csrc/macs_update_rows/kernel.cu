// Torch-free instantiations for every supported dtype (plain nvcc compiles this file alone).
#include "macs_update_rows/kernel.cuh"

namespace macs {
template cudaError_t macs_update_rows<float>(const RowsParams<float>&, cudaStream_t);
template cudaError_t macs_update_rows<__half>(const RowsParams<__half>&, cudaStream_t);
template cudaError_t macs_update_rows<__nv_bfloat16>(const RowsParams<__nv_bfloat16>&, cudaStream_t);
}  // namespace macs

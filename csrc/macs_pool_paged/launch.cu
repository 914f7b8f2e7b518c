// CUDA kernel of macs_kernels::macs_pool_paged (the operator is defined in
// macs_kernels/ops/macs_pool_paged.py): macs_pool's launch (attention variants included) with the keys staged from
// pages through the block table.
#include <torch/library.h>

#include "macs_pool/launch.h"

namespace macs {
namespace {

void macs_pool_paged_cuda(const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& block_table,
                          at::Tensor& out, const at::Tensor& input_start, const at::Tensor& input_end,
                          const at::Tensor& kv_len, double scale, std::string_view pooling, bool redistribute,
                          const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& score_start,
                          std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  launch_macs_pool("macs_pool_paged", q, k_pages, &block_table, out, input_start, input_end, kv_len, scale,
                   pooling, redistribute, lse, score_start, softcap, sinks);
}

}  // namespace
}  // namespace macs

TORCH_LIBRARY_IMPL(macs_kernels, CUDA, m) { m.impl("macs_pool_paged", &macs::macs_pool_paged_cuda); }

// CUDA kernel of macs_kernels::macs_zscore (the operator is defined in macs_kernels/ops/macs_zscore.py).
#include <torch/library.h>

#include "launch_utils.h"
#include "macs_zscore/kernel.cuh"

namespace macs {
namespace {

at::Tensor macs_zscore_cuda(const at::Tensor& log_c, const at::Tensor& n_input) {
  constexpr const char* op = "macs_zscore";
  check_tensor(op, "log_c", log_c, 2, log_c);
  TORCH_CHECK(log_c.scalar_type() == at::kFloat, op, ": log_c must be float32, got ", log_c.scalar_type());
  TORCH_CHECK(log_c.is_contiguous(), op, ": log_c must be contiguous");
  const int64_t batch = log_c.size(0), n_max = log_c.size(1);
  const Index counts = index_arg(op, "n_input", n_input, batch, log_c);
  at::Tensor z = at::empty({batch, n_max}, log_c.options());
  if (batch == 0 || n_max == 0) return z;

  const c10::cuda::CUDAGuard guard(log_c.device());
  const ZscoreParams p{log_c.data_ptr<float>(), counts, z.data_ptr<float>(), batch, n_max};
  check_launch(op, macs_zscore(p, c10::cuda::getCurrentCUDAStream()));
  return z;
}

}  // namespace
}  // namespace macs

TORCH_LIBRARY_IMPL(macs_kernels, CUDA, m) { m.impl("macs_zscore", &macs::macs_zscore_cuda); }

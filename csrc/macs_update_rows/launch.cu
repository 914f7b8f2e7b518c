// CUDA kernel of macs_kernels::macs_update_rows (the operator is defined in
// macs_kernels/ops/macs_update_rows.py): each row's generated mass, then head pooling into log_c.
#include <torch/library.h>

#include "launch_utils.h"
#include "macs_update_rows/kernel.cuh"

namespace macs {
namespace {

void macs_update_rows_cuda(const at::Tensor& rows, at::Tensor& log_c, const at::Tensor& input_start,
                           const at::Tensor& input_end, const at::Tensor& kv_len, double alpha,
                           std::string_view pooling, bool redistribute) {
  constexpr const char* op = "macs_update_rows";
  check_tensor(op, "rows", rows, 3, rows);
  check_float(op, "rows", rows);
  const int64_t batch = rows.size(0), heads = rows.size(1), keys = rows.size(2);
  check_state(op, "log_c", log_c, {batch}, rows);
  const Index start = index_arg(op, "input_start", input_start, batch, rows);
  const Index inputs_end = index_arg(op, "input_end", input_end, batch, rows);
  const Index end = index_arg(op, "kv_len", kv_len, batch, rows);
  const Pooling pool = pooling_arg(op, pooling);
  if (batch == 0 || heads == 0 || log_c.size(1) == 0) return;

  const c10::cuda::CUDAGuard guard(rows.device());
  at::Tensor stats = at::empty({batch, heads, 2}, rows.options().dtype(at::kFloat));
  dispatch_float(op, rows.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const RowsParams<T> p{pointer<T>(rows), rows.stride(0), rows.stride(1), batch, heads, keys,
                          log_c.data_ptr<float>(), log_c.size(1), start, inputs_end, end, float(alpha), pool,
                          redistribute, stats.data_ptr<float>(),
                          device_attribute(cudaDevAttrMultiProcessorCount, rows)};
    check_launch(op, macs_update_rows<T>(p, c10::cuda::getCurrentCUDAStream()));
  });
}

}  // namespace
}  // namespace macs

TORCH_LIBRARY_IMPL(macs_kernels, CUDA, m) { m.impl("macs_update_rows", &macs::macs_update_rows_cuda); }

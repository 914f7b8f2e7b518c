// CUDA kernel of macs_kernels::macs_pool (the operator is defined in macs_kernels/ops/macs_pool.py): the
// split-KV pass without V over R query rows per sequence, each row with its own key range, then head
// pooling of its scores into out, m' stored before the floor (pool/kernel.cuh).
#include <torch/library.h>

#include "launch_utils.h"

namespace macs {
namespace {

void macs_pool_cuda(const at::Tensor& q, const at::Tensor& k_cache, at::Tensor& out, const at::Tensor& input_start,
                    const at::Tensor& input_end, const at::Tensor& kv_len, double scale, std::string_view pooling,
                    bool redistribute, const std::optional<at::Tensor>& lse) {
  constexpr const char* op = "macs_pool";
  const SplitShape shape(op, q, 4, k_cache, nullptr);
  check_state(op, "out", out, {shape.batch, shape.rows}, q);
  const Index start = index_arg(op, "input_start", input_start, shape.batch, q, shape.rows);
  const Index inputs_end = index_arg(op, "input_end", input_end, shape.batch, q, shape.rows);
  const Index end = index_arg(op, "kv_len", kv_len, shape.batch, q, shape.rows);
  const Pooling pool = pooling_arg(op, pooling);
  const at::Tensor lse_float =
      lse.has_value() ? lse_arg(op, *lse, {shape.batch, shape.heads, shape.rows}, q) : at::Tensor();
  if (out.numel() == 0) return;
  TORCH_CHECK(shape.heads > 0, op, ": q must have at least one head to pool over, got shape ", q.sizes());

  const PoolTail tail{out.data_ptr<float>(), out.size(2), 0.0f, pool, PoolEpilogue::kStore, nullptr};
  SplitRun{op, shape, q, k_cache, nullptr, start, inputs_end, end, scale, lse.has_value() ? &lse_float : nullptr,
           redistribute, nullptr, nullptr, tail}.launch();
}

}  // namespace
}  // namespace macs

TORCH_LIBRARY_IMPL(macs_kernels, CUDA, m) { m.impl("macs_pool", &macs::macs_pool_cuda); }

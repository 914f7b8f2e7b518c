// CUDA kernel of macs_kernels::macs_update (the operator is defined in macs_kernels/ops/macs_update.py):
// the split-KV pass without V over one query row per sequence, then head pooling of its scores into
// log_c, the layer's floor term added (pool/kernel.cuh).
#include <torch/library.h>

#include "launch_utils.h"

namespace macs {
namespace {

void macs_update_cuda(const at::Tensor& q, const at::Tensor& k_cache, at::Tensor& log_c,
                      const at::Tensor& input_start, const at::Tensor& input_end, const at::Tensor& kv_len,
                      double scale, double alpha, std::string_view pooling, bool redistribute,
                      const std::optional<at::Tensor>& lse) {
  constexpr const char* op = "macs_update";
  const SplitShape shape(op, q, 3, k_cache, nullptr);
  check_state(op, "log_c", log_c, {shape.batch}, q);
  const Index start = index_arg(op, "input_start", input_start, shape.batch, q);
  const Index inputs_end = index_arg(op, "input_end", input_end, shape.batch, q);
  const Index end = index_arg(op, "kv_len", kv_len, shape.batch, q);
  const Pooling pool = pooling_arg(op, pooling);
  const at::Tensor lse_float = lse.has_value() ? lse_arg(op, *lse, {shape.batch, shape.heads}, q) : at::Tensor();
  if (shape.batch == 0 || shape.heads == 0 || log_c.size(1) == 0) return;

  const PoolTail tail{log_c.data_ptr<float>(), log_c.size(1), float(alpha), pool, PoolEpilogue::kAddLogFloor, nullptr};
  SplitRun{op, shape, q, k_cache, nullptr, start, inputs_end, end, scale, lse.has_value() ? &lse_float : nullptr,
           redistribute, nullptr, nullptr, tail}.launch();
}

}  // namespace
}  // namespace macs

TORCH_LIBRARY_IMPL(macs_kernels, CUDA, m) { m.impl("macs_update", &macs::macs_update_cuda); }

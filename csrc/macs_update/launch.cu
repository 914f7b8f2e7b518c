#include "launch_utils.h"
#include "launchers.h"
#include "macs_update/kernel.cuh"

namespace macs {

void macs_update_cuda(const at::Tensor& q, const at::Tensor& k_cache, at::Tensor& log_c,
                      const at::Tensor& input_start, const at::Tensor& input_end, const at::Tensor& kv_len,
                      double scale, double alpha, std::string_view pooling, bool redistribute,
                      const std::optional<at::Tensor>& lse) {
  constexpr const char* op = "macs_update";
  const SplitShape shape(op, q, k_cache, nullptr);
  check_log_c(op, log_c, shape.batch, q);
  const Index start = index_arg(op, "input_start", input_start, shape.batch, q);
  const Index inputs_end = index_arg(op, "input_end", input_end, shape.batch, q);
  const Index end = index_arg(op, "kv_len", kv_len, shape.batch, q);
  const Pooling pool = pooling_arg(op, pooling);
  at::Tensor lse_float;
  if (lse.has_value()) {
    check_tensor(op, "lse", *lse, 2, q);
    TORCH_CHECK(lse->size(0) == shape.batch && lse->size(1) == shape.heads, op, ": lse must be (", shape.batch,
                ", ", shape.heads, "), got ", lse->sizes());
    TORCH_CHECK(lse->is_floating_point(), op, ": lse must be floating point, got ", lse->scalar_type());
    lse_float = lse->to(at::kFloat).contiguous();
  }
  if (shape.batch == 0 || log_c.size(1) == 0) return;

  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t splits = shape.splits(q);
  const auto floats = q.options().dtype(at::kFloat);
  at::Tensor scores = at::empty({shape.batch, shape.heads, shape.keys}, floats);
  at::Tensor part_stats = at::empty({shape.batch, shape.heads, splits, 4}, floats);
  at::Tensor stats = at::empty({shape.batch, shape.heads, 2}, floats);
  dispatch_float(op, q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const SplitParams<T> p = split_params<T>(shape, q, k_cache, nullptr, start, inputs_end, end, scale, splits,
                                             part_stats, nullptr, &scores);
    const CombineParams<T> combine{part_stats.data_ptr<float>(), nullptr, shape.heads, splits, 0,
                                   lse.has_value() ? lse_float.data_ptr<float>() : nullptr, redistribute,
                                   stats.data_ptr<float>(), nullptr, nullptr};
    const PoolTail tail{log_c.data_ptr<float>(), log_c.size(1), float(alpha), pool, stats.data_ptr<float>()};
    check_launch(op, macs_update<T>(p, combine, tail, shape.vectorized, c10::cuda::getCurrentCUDAStream()));
  });
}

}  // namespace macs

#include "decode_attention/kernel.cuh"
#include "launch_utils.h"
#include "launchers.h"

namespace macs {

std::tuple<at::Tensor, at::Tensor> decode_attention_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& kv_start,
    const at::Tensor& kv_len, double scale, const std::optional<at::Tensor>& log_c,
    const std::optional<at::Tensor>& input_end, double alpha, std::string_view pooling, bool redistribute) {
  constexpr const char* op = "decode_attention";
  const SplitShape shape(op, q, k_cache, &v_cache);
  const Index start = index_arg(op, "kv_start", kv_start, shape.batch, q);
  const Index end = index_arg(op, "kv_len", kv_len, shape.batch, q);
  TORCH_CHECK(log_c.has_value() == input_end.has_value(), op,
              ": log_c and input_end come together (input_end is the end of the input keys)");
  // Without the MACS update there are no generated keys to track: input_end = kv_len.
  Index inputs_end = end;
  if (log_c.has_value()) {
    check_log_c(op, *log_c, shape.batch, q);
    inputs_end = index_arg(op, "input_end", *input_end, shape.batch, q);
  }
  const Pooling pool = pooling_arg(op, pooling);
  at::Tensor out = at::empty({shape.batch, shape.heads, shape.dim_v}, q.options());
  const auto floats = q.options().dtype(at::kFloat);
  at::Tensor lse = at::empty({shape.batch, shape.heads}, floats);
  if (shape.batch == 0 || shape.heads == 0) return {out, lse};

  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t splits = shape.splits(q);
  at::Tensor part_stats = at::empty({shape.batch, shape.heads, splits, 4}, floats);
  at::Tensor part_acc = at::empty({shape.batch, shape.heads, splits, shape.dim_v}, floats);
  at::Tensor scores, stats;
  if (log_c.has_value()) {
    scores = at::empty({shape.batch, shape.heads, shape.keys}, floats);
    stats = at::empty({shape.batch, shape.heads, 2}, floats);
  }
  dispatch_float(op, q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const SplitParams<T> p = split_params<T>(shape, q, k_cache, &v_cache, start, inputs_end, end, scale, splits,
                                             part_stats, &part_acc, log_c.has_value() ? &scores : nullptr);
    float* stats_data = log_c.has_value() ? stats.data_ptr<float>() : nullptr;
    const CombineParams<T> combine{part_stats.data_ptr<float>(), part_acc.data_ptr<float>(), shape.heads, splits,
                                   shape.dim_v, nullptr, redistribute, stats_data, lse.data_ptr<float>(),
                                   reinterpret_cast<T*>(out.data_ptr())};
    const PoolTail tail{log_c.has_value() ? log_c->data_ptr<float>() : nullptr,
                        log_c.has_value() ? log_c->size(1) : 0, float(alpha), pool, stats_data};
    check_launch(op, decode_attention<T>(p, combine, tail, shape.vectorized, c10::cuda::getCurrentCUDAStream()));
  });
  return {out, lse};
}

}  // namespace macs

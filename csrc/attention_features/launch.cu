// CUDA kernel of macs_kernels::attention_features (the operator is defined in
// macs_kernels/ops/attention_features.py).
#include <torch/library.h>

#include "launch_utils.h"
#include "attention_features/kernel.cuh"

namespace macs {
namespace {

at::Tensor attention_features_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& source_start,
                                   const at::Tensor& source_end, const at::Tensor& kv_start, const at::Tensor& kv_len,
                                   const at::Tensor& n_rows, int64_t n_max, double scale,
                                   const std::optional<at::Tensor>& lse, std::optional<int64_t> window,
                                   std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  constexpr const char* op = "attention_features";
  check_tensor(op, "q", q, 4, q);
  check_tensor(op, "k_cache", k_cache, 4, q);
  check_float(op, "q", q);
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), op, ": q and k_cache must share a dtype, got ",
              q.scalar_type(), " and ", k_cache.scalar_type());
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2), dim = q.size(3);
  TORCH_CHECK(k_cache.size(0) == batch && k_cache.size(3) == dim, op, ": k_cache must be (", batch, ", H_kv, S, ",
              dim, "), got ", k_cache.sizes());
  TORCH_CHECK(k_cache.size(1) > 0 && heads % k_cache.size(1) == 0, op, ": query heads (", heads,
              ") must be a multiple of KV heads (", k_cache.size(1), ")");
  TORCH_CHECK(dim <= kFeatureMaxDim, op, ": the cuda backend supports D <= ", kFeatureMaxDim, ", got ", dim);
  TORCH_CHECK(n_max >= 0, op, ": n_max must be >= 0, got ", n_max);
  TORCH_CHECK(!window.has_value() || *window >= 1, op, ": window must be >= 1, got ", window.value_or(0));
  const VariantArgs variant(op, std::nullopt, softcap, sinks, batch, heads, q);
  FeaturesParams<float> index{};
  index.source_start = index_arg(op, "source_start", source_start, batch, q);
  index.source_end = index_arg(op, "source_end", source_end, batch, q);
  index.kv_start = index_arg(op, "kv_start", kv_start, batch, q);
  index.kv_len = index_arg(op, "kv_len", kv_len, batch, q);
  index.n_rows = index_arg(op, "n_rows", n_rows, batch, q);
  const auto floats = q.options().dtype(at::kFloat);
  const at::Tensor lse_float =
      lse.has_value() ? lse_arg(op, *lse, {batch, heads, rows}, q) : at::empty({batch, heads, rows}, floats);
  at::Tensor out = at::empty({batch, heads, n_max}, floats);
  if (batch == 0 || heads == 0 || n_max == 0) return out;

  const c10::cuda::CUDAGuard guard(q.device());
  dispatch_float(op, q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const FeaturesParams<T> p{
        pointer<T>(q), q.stride(0), q.stride(1), q.stride(2),
        pointer<T>(k_cache), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        lse_float.data_ptr<float>(),
        index.source_start, index.source_end, index.kv_start, index.kv_len, index.n_rows,
        float(scale * double(kLog2e)), batch, heads, heads / k_cache.size(1), rows, dim, k_cache.size(2), n_max,
        out.data_ptr<float>(),
        window.value_or(k_cache.size(2) + 1),
        variant.softcap > 0.0 ? float(scale / variant.softcap) : 0.0f, float(variant.softcap * double(kLog2e)),
        variant.sinks.defined() ? variant.sinks.data_ptr<float>() : nullptr,
    };
    check_launch(op, attention_features<T>(p, !lse.has_value(), c10::cuda::getCurrentCUDAStream()));
  });
  return out;
}

}  // namespace
}  // namespace macs

TORCH_LIBRARY_IMPL(macs_kernels, CUDA, m) { m.impl("attention_features", &macs::attention_features_cuda); }

// CUDA kernel of macs_kernels::decode_attention (the operator is defined in
// macs_kernels/ops/decode_attention.py): the split-KV pass with V over one query row per sequence, giving
// out and lse; with log_c, head pooling of its scores adds the layer's MACS term to log_c; with pooled,
// it stores m' before the floor (pool/kernel.cuh). K is read once for all of it. score_start, softcap and
// sinks: the layer's attention variant (launch_utils.h's VariantArgs; score_start with pooled only).
#include <torch/library.h>

#include <tuple>

#include "launch_utils.h"

namespace macs {
namespace {

std::tuple<at::Tensor, at::Tensor> decode_attention_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& kv_start,
    const at::Tensor& kv_len, double scale, const std::optional<at::Tensor>& log_c,
    const std::optional<at::Tensor>& input_end, double alpha, std::string_view pooling, bool redistribute,
    const std::optional<at::Tensor>& pooled, const std::optional<at::Tensor>& score_start,
    std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  constexpr const char* op = "decode_attention";
  const SplitShape shape(op, q, 3, k_cache, &v_cache);
  const Index start = index_arg(op, "kv_start", kv_start, shape.batch, q);
  const Index end = index_arg(op, "kv_len", kv_len, shape.batch, q);
  TORCH_CHECK(!(log_c.has_value() && pooled.has_value()), op, ": give log_c or pooled, not both");
  const std::optional<at::Tensor>& state = log_c.has_value() ? log_c : pooled;
  const char* state_name = log_c.has_value() ? "log_c" : "pooled";
  TORCH_CHECK(state.has_value() == input_end.has_value(), op,
              ": input_end (the end of the input keys) comes with log_c or pooled, and only with them");
  TORCH_CHECK(!(score_start.has_value() && log_c.has_value()), op,
              ": score_start (a sliding window's input columns) comes with pooled, not log_c");
  const VariantArgs variant(op, score_start, softcap, sinks, shape.batch, shape.heads, q);
  // Without MACS there are no generated keys to track: input_end = kv_len.
  Index inputs_end = end;
  PoolTail tail{nullptr, 0, float(alpha), pooling_arg(op, pooling), PoolEpilogue::kAddLogFloor, nullptr,
                variant.score_start};
  if (state.has_value()) {
    check_state(op, state_name, *state, {shape.batch}, q);
    inputs_end = index_arg(op, "input_end", *input_end, shape.batch, q);
    tail.out = state->data_ptr<float>();
    tail.n_max = state->size(1);
    if (pooled.has_value()) tail.epilogue = PoolEpilogue::kStore;
  }
  at::Tensor out = at::empty({shape.batch, shape.heads, shape.dim_v}, q.options());
  at::Tensor lse = at::empty({shape.batch, shape.heads}, q.options().dtype(at::kFloat));
  const NamedBuffers named({NamedBuffers::of("out", out), NamedBuffers::of("lse", lse)});
  if (shape.batch == 0 || shape.heads == 0) return {out, lse};
  if (tail.n_max == 0) tail.out = nullptr;

  SplitRun{op, shape, q, k_cache, &v_cache, start, inputs_end, end, scale, nullptr, redistribute, &out, &lse, tail,
           nullptr, &variant}.launch();
  return {out, lse};
}

}  // namespace
}  // namespace macs

TORCH_LIBRARY_IMPL(macs_kernels, CUDA, m) { m.impl("decode_attention", &macs::decode_attention_cuda); }

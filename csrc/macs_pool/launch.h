// The launch shared by macs_pool and macs_pool_paged: the split-KV pass without V over R query rows per
// sequence, each row with its own key range, then head pooling of its scores into out, m' stored before the
// floor (pool/kernel.cuh). Keys are contiguous (block_table null) or in pages read through the block table.
// score_start, softcap and sinks: the layer's attention variant (launch_utils.h's VariantArgs).
// q (B, H, R, D) with ranges (B, R), out (B, R, N_max) and lse (B, H, R); or one row per item, q (B, H, D) with
// (B,), (B, N_max) and (B, H), as the public op passes it (no views to make on the host).
#pragma once

#include "launch_utils.h"

namespace macs {

inline void launch_macs_pool(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor* block_table,
                             at::Tensor& out, const at::Tensor& input_start, const at::Tensor& input_end,
                             const at::Tensor& kv_len, double scale, std::string_view pooling, bool redistribute,
                             const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& score_start = {},
                             std::optional<double> softcap = {}, const std::optional<at::Tensor>& sinks = {}) {
  const bool block = q.dim() != 3;
  const SplitShape shape(op, q, block ? 4 : 3, k, nullptr, block_table);
  // Per-row arguments: (B, R) with a block; (B,) for one row per item (rows -1: index_arg's (B,) form).
  const int64_t rows = block ? shape.rows : -1;
  if (block) {
    check_state(op, "out", out, {shape.batch, shape.rows}, q);
  } else {
    check_state(op, "out", out, {shape.batch}, q);
  }
  const Index start = index_arg(op, "input_start", input_start, shape.batch, q, rows);
  const Index inputs_end = index_arg(op, "input_end", input_end, shape.batch, q, rows);
  const Index end = index_arg(op, "kv_len", kv_len, shape.batch, q, rows);
  const Pooling pool = pooling_arg(op, pooling);
  const VariantArgs variant(op, score_start, softcap, sinks, shape.batch, shape.heads, q, rows);
  at::Tensor lse_float;
  if (lse.has_value()) {
    lse_float = block ? lse_arg(op, *lse, {shape.batch, shape.heads, shape.rows}, q)
                      : lse_arg(op, *lse, {shape.batch, shape.heads}, q);
  }
  if (out.numel() == 0) return;
  TORCH_CHECK(shape.heads > 0, op, ": q must have at least one head to pool over, got shape ", q.sizes());

  const PoolTail tail{out.data_ptr<float>(), out.size(-1), 0.0f, pool, PoolEpilogue::kStore, nullptr,
                      variant.score_start};
  SplitRun{op, shape, q, k, nullptr, start, inputs_end, end, scale, lse.has_value() ? &lse_float : nullptr,
           redistribute, nullptr, nullptr, tail, block_table, &variant}.launch();
}

}  // namespace macs

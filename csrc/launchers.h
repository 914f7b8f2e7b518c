// The CUDA kernels of the macs_kernels operators, as registered in bindings.cpp. Their schemas are in
// macs_kernels/ops/library.py; each launcher checks shapes, dtypes, devices and strides, then calls the
// torch-free host function of csrc/<op>/kernel.cuh on the current stream.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>
#include <tuple>

namespace macs {

void macs_update_cuda(const at::Tensor& q, const at::Tensor& k_cache, at::Tensor& log_c,
                      const at::Tensor& input_start, const at::Tensor& input_end, const at::Tensor& kv_len,
                      double scale, double alpha, std::string_view pooling, bool redistribute,
                      const std::optional<at::Tensor>& lse);

void macs_update_rows_cuda(const at::Tensor& rows, at::Tensor& log_c, const at::Tensor& input_start,
                           const at::Tensor& input_end, const at::Tensor& kv_len, double alpha,
                           std::string_view pooling, bool redistribute);

at::Tensor macs_zscore_cuda(const at::Tensor& log_c, const at::Tensor& n_input);

std::tuple<at::Tensor, at::Tensor> decode_attention_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& kv_start,
    const at::Tensor& kv_len, double scale, const std::optional<at::Tensor>& log_c,
    const std::optional<at::Tensor>& input_end, double alpha, std::string_view pooling, bool redistribute);

at::Tensor attention_features_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& source_start,
                                   const at::Tensor& source_end, const at::Tensor& kv_start, const at::Tensor& kv_len,
                                   const at::Tensor& n_rows, int64_t n_max, double scale,
                                   const std::optional<at::Tensor>& lse);

}  // namespace macs

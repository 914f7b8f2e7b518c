// Torch-side helpers shared by the launchers: argument checks with readable messages, dtype dispatch,
// and the split pass's parameters. The schemas (and the argument checks users normally go through) are
// in macs_kernels/ops/library.py and ops/__init__.py; these checks guard direct torch.ops calls.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string_view>

#include "decode_attention/kernel.cuh"

namespace macs {

inline void check_tensor(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                         const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(), " but the data is on ",
              like.device());
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions, got shape ", t.sizes());
  TORCH_CHECK(t.numel() == 0 || t.stride(-1) == 1, op, ": ", name,
              " must have unit stride in its last dimension, got strides ", t.strides());
}

inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  const auto type = t.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16, op, ": ", name,
              " must be float32, float16 or bfloat16, got ", type);
}

inline Index index_arg(const char* op, const char* name, const at::Tensor& t, int64_t batch,
                       const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), op, ": ", name, " must be on ", like.device(),
              ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong, op, ": ", name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == batch, op, ": ", name, " must have shape (", batch, ",), got ",
              t.sizes());
  return Index{t.data_ptr<int64_t>(), t.stride(0)};
}

inline void check_log_c(const char* op, const at::Tensor& log_c, int64_t batch, const at::Tensor& like) {
  check_tensor(op, "log_c", log_c, 2, like);
  TORCH_CHECK(log_c.scalar_type() == at::kFloat, op, ": log_c must be float32, got ", log_c.scalar_type());
  TORCH_CHECK(log_c.size(0) == batch, op, ": log_c must have ", batch, " rows, got shape ", log_c.sizes());
  TORCH_CHECK(log_c.is_contiguous(), op, ": log_c must be contiguous: it is updated in place");
}

inline Pooling pooling_arg(const char* op, std::string_view pooling) {
  if (pooling == "max") return Pooling::kMax;
  if (pooling == "mean") return Pooling::kMean;
  TORCH_CHECK(pooling == "min", op, ": pooling must be 'max', 'mean' or 'min', got '", std::string(pooling), "'");
  return Pooling::kMin;
}

// 16-byte loads need every row of the last dimension to start on a 16-byte boundary.
inline bool rows_aligned16(const at::Tensor& t) {
  const int64_t vec = 16 / t.element_size();
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0 || t.size(-1) % vec != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) % vec != 0) return false;
  }
  return true;
}

inline void check_launch(const char* op, cudaError_t error) {
  TORCH_CHECK(error == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(error));
}

inline int64_t device_attribute(cudaDeviceAttr attribute, const at::Tensor& like) {
  int value = 0;
  check_launch("device query", cudaDeviceGetAttribute(&value, attribute, like.get_device()));
  return value;
}

// Calls f(T{}) with T the CUDA element type of `type`.
template <typename F>
void dispatch_float(const char* op, at::ScalarType type, F&& f) {
  switch (type) {
    case at::kFloat:
      return f(float{});
    case at::kHalf:
      return f(__half{});
    case at::kBFloat16:
      return f(__nv_bfloat16{});
    default:
      TORCH_CHECK(false, op, ": dtype must be float32, float16 or bfloat16, got ", type);
  }
}

template <typename T>
const T* pointer(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

// Shapes of q (B, H, D) against k_cache (B, H_kv, S, D) and v_cache (B, H_kv, S, D_v), checked for the
// split pass, which also needs every head group to fit its registers and shared memory.
struct SplitShape {
  int64_t batch, heads, kv_heads, keys, dim, dim_v;
  bool vectorized;

  SplitShape(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor* v) {
    check_tensor(op, "q", q, 3, q);
    check_tensor(op, "k_cache", k, 4, q);
    check_float(op, "q", q);
    TORCH_CHECK(k.scalar_type() == q.scalar_type(), op, ": q and k_cache must share a dtype, got ",
                q.scalar_type(), " and ", k.scalar_type());
    batch = q.size(0);
    heads = q.size(1);
    dim = q.size(2);
    kv_heads = k.size(1);
    keys = k.size(2);
    TORCH_CHECK(k.size(0) == batch && k.size(3) == dim, op, ": k_cache must be (", batch, ", H_kv, S, ", dim,
                "), got ", k.sizes());
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, op, ": query heads (", heads,
                ") must be a multiple of KV heads (", kv_heads, ")");
    vectorized = rows_aligned16(k);
    dim_v = 0;
    if (v != nullptr) {
      check_tensor(op, "v_cache", *v, 4, q);
      TORCH_CHECK(v->scalar_type() == q.scalar_type(), op, ": q and v_cache must share a dtype, got ",
                  q.scalar_type(), " and ", v->scalar_type());
      TORCH_CHECK(v->size(0) == batch && v->size(1) == kv_heads && v->size(2) == keys, op,
                  ": v_cache must be (", batch, ", ", kv_heads, ", ", keys, ", D_v), got ", v->sizes());
      dim_v = v->size(3);
      vectorized = vectorized && rows_aligned16(*v);
    }
    const int64_t group = heads / kv_heads;
    TORCH_CHECK(group * dim_v <= kMaxGroupTimesDimV, op, ": the cuda backend supports (H / H_kv) * D_v <= ",
                kMaxGroupTimesDimV, ", got ", group, " * ", dim_v);
    const int64_t smem = int64_t(split_smem_bytes(group, dim, dim_v, v != nullptr));
    const int64_t limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, q);
    TORCH_CHECK(smem <= limit, op, ": a head group of ", group, " with D=", dim, ", D_v=", dim_v, " needs ", smem,
                " bytes of shared memory; this GPU allows ", limit);
  }

  int64_t splits(const at::Tensor& like) const {
    return choose_splits(batch, kv_heads, keys, device_attribute(cudaDevAttrMultiProcessorCount, like));
  }
};

template <typename T>
SplitParams<T> split_params(const SplitShape& shape, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor* v, Index start, Index input_end, Index end, double scale,
                            int64_t splits, at::Tensor& part_stats, at::Tensor* part_acc, at::Tensor* scores) {
  return SplitParams<T>{
      pointer<T>(q),  q.stride(0),  q.stride(1),
      pointer<T>(k),  k.stride(0),  k.stride(1),  k.stride(2),
      v == nullptr ? nullptr : pointer<T>(*v),
      v == nullptr ? 0 : v->stride(0),
      v == nullptr ? 0 : v->stride(1),
      v == nullptr ? 0 : v->stride(2),
      start,          input_end,    end,          float(scale),
      shape.batch,    shape.heads,  shape.kv_heads, shape.keys, shape.dim, shape.dim_v, splits,
      part_stats.data_ptr<float>(),
      part_acc == nullptr ? nullptr : part_acc->data_ptr<float>(),
      scores == nullptr ? nullptr : scores->data_ptr<float>(),
  };
}

}  // namespace macs

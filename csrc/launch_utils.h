// Torch-side helpers shared by the launchers (csrc/<op>/launch.cu): argument checks whose messages name
// the op and the argument, dtype dispatch, and the split-KV pass's shapes, scratch and launch. Python
// (macs_kernels/ops/<op>.py) defines each operator and validates the public arguments; these checks
// guard direct torch.ops calls, so that a bad call fails with a message instead of reading out of bounds.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pool/kernel.cuh"
#include "split_kv_mma/kernel.cuh"

namespace macs {

// Names the buffers a launcher allocates (scratch, outputs) in the CPU emulation's byte counts, which credit each
// access to the buffer it falls in (macs_kernels/apps/bench/traffic.py), for as long as it lives (declare it after
// them); a GPU build compiles nothing here.
class NamedBuffers {
 public:
  struct Span {
    const char* name;
    const void* data;  // null: not allocated, nothing to name
    size_t bytes;
  };
  static Span of(const char* name, const at::Tensor& t) {
    return {name, t.defined() ? t.data_ptr() : nullptr, t.defined() ? t.nbytes() : 0};
  }

  NamedBuffers(std::initializer_list<Span> buffers) {
#ifdef MACS_CPU_EMULATION
    for (const Span& buffer : buffers) {
      if (buffer.data != nullptr) {
        cuda_emulation::name_buffer(buffer.name, buffer.data, buffer.bytes);
        named_.push_back(buffer.data);
      }
    }
#else
    (void)buffers;
#endif
  }
  NamedBuffers(const NamedBuffers&) = delete;
  NamedBuffers& operator=(const NamedBuffers&) = delete;
#ifdef MACS_CPU_EMULATION
  ~NamedBuffers() {
    for (const void* data : named_) cuda_emulation::forget_buffer(data);
  }

 private:
  std::vector<const void*> named_;
#endif
};

inline void check_tensor(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                         const at::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " is on ", t.device(), " but the data is on ",
              like.device());
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dimensions, got shape ", t.sizes());
  // A last dimension of one element is read at offset 0 whatever its stride (the public ops' rule too: torch calls such
  // a tensor contiguous).
  TORCH_CHECK(t.numel() == 0 || t.size(-1) == 1 || t.stride(-1) == 1, op, ": ", name,
              " must have unit stride in its last dimension, got strides ", t.strides());
}

inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  const auto type = t.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kHalf || type == at::kBFloat16, op, ": ", name,
              " must be float32, float16 or bfloat16, got ", type);
}

// A float32 (leading..., N_max) tensor, contiguous, that the kernel writes in place (log_c, out, pooled).
inline void check_state(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef leading,
                        const at::Tensor& like) {
  std::string expected = "(";
  for (const int64_t size : leading) expected += std::to_string(size) + ", ";
  expected += "N_max)";
  check_tensor(op, name, t, int64_t(leading.size()) + 1, like);
  TORCH_CHECK(t.sizes().slice(0, leading.size()) == leading, op, ": ", name, " must have shape ", expected,
              ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous: it is written in place");
}

// An int32 or int64 index tensor of shape (batch,), or (batch, rows) when rows >= 0.
inline Index index_arg(const char* op, const char* name, const at::Tensor& t, int64_t batch,
                       const at::Tensor& like, int64_t rows = -1) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), op, ": ", name, " must be on ", like.device(),
              ", got ", t.device());
  const bool is_int32 = t.scalar_type() == at::kInt;
  TORCH_CHECK(is_int32 || t.scalar_type() == at::kLong, op, ": ", name, " must be int32 or int64, got ",
              t.scalar_type());
  if (rows < 0) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == batch, op, ": ", name, " must have shape (", batch, ",), got ",
                t.sizes());
    return Index{t.data_ptr(), t.stride(0), 0, is_int32};
  }
  TORCH_CHECK(t.dim() == 2 && t.size(0) == batch && t.size(1) == rows, op, ": ", name, " must have shape (",
              batch, ", ", rows, "), got ", t.sizes());
  return Index{t.data_ptr(), t.stride(0), t.stride(1), is_int32};
}

// A given log-sum-exp of `sizes`, any float dtype, as the float32 contiguous tensor the kernels read.
inline at::Tensor lse_arg(const char* op, const at::Tensor& lse, at::IntArrayRef sizes, const at::Tensor& like) {
  check_tensor(op, "lse", lse, int64_t(sizes.size()), like);
  TORCH_CHECK(lse.sizes() == sizes, op, ": lse must have shape ", sizes, ", got ", lse.sizes());
  TORCH_CHECK(lse.is_floating_point(), op, ": lse must be floating point, got ", lse.scalar_type());
  return lse.to(at::kFloat).contiguous();
}

// The attention-variant arguments of a split-KV op (macs_kernels/ops/variant.py): the rows' input columns'
// start when they precede the attended start (a sliding window), the softcap (> 0) and (H,) sink logits.
struct VariantArgs {
  Index score_start{nullptr, 0, 0};
  double softcap = 0.0;  // 0: off
  at::Tensor sinks;      // float32 contiguous, or undefined

  VariantArgs(const char* op, const std::optional<at::Tensor>& score_start_, std::optional<double> softcap_,
              const std::optional<at::Tensor>& sinks_, int64_t batch, int64_t heads, const at::Tensor& like,
              int64_t rows = -1) {
    if (score_start_.has_value()) score_start = index_arg(op, "score_start", *score_start_, batch, like, rows);
    if (softcap_.has_value()) {
      TORCH_CHECK(*softcap_ > 0.0 && *softcap_ < kInf, op, ": softcap must be a finite float > 0, got ",
                  *softcap_);
      softcap = *softcap_;
    }
    if (sinks_.has_value()) {
      check_tensor(op, "sinks", *sinks_, 1, like);
      TORCH_CHECK(sinks_->size(0) == heads, op, ": sinks must have shape (", heads, ",), one logit per query head, "
                  "got ", sinks_->sizes());
      TORCH_CHECK(sinks_->is_floating_point(), op, ": sinks must be floating point, got ", sinks_->scalar_type());
      sinks = sinks_->to(at::kFloat).contiguous();
    }
  }
};

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

// q (B, H, D) or (B, H, R, D) against k_cache (B, H_kv, S, D) and v_cache (B, H_kv, S, D_v), or against
// pages k_cache (P, page_size, H_kv, D) and their block_table (B, pages) int32 (then S = pages * page_size
// per item, and no V), checked for the split-KV pass, with its tile policy for this GPU (which must fit
// the block in shared memory) for the kernel the shape runs (SplitKernel).
struct SplitShape {
  int64_t batch, heads, kv_heads, rows, keys, dim, dim_v;
  int64_t page_size = 0;  // 0: contiguous keys
  int64_t sm_count = 0;
  bool vectorized;
  SplitPolicy policy;

  SplitShape(const char* op, const at::Tensor& q, int64_t q_dims, const at::Tensor& k, const at::Tensor* v,
             const at::Tensor* block_table = nullptr) {
    const char* k_name = block_table == nullptr ? "k_cache" : "k_pages";
    check_tensor(op, "q", q, q_dims, q);
    check_tensor(op, k_name, k, 4, q);
    check_float(op, "q", q);
    TORCH_CHECK(k.scalar_type() == q.scalar_type(), op, ": q and ", k_name, " must share a dtype, got ",
                q.scalar_type(), " and ", k.scalar_type());
    batch = q.size(0);
    heads = q.size(1);
    rows = q_dims == 4 ? q.size(2) : 1;
    dim = q.size(-1);
    if (block_table == nullptr) {
      kv_heads = k.size(1);
      keys = k.size(2);
      TORCH_CHECK(k.size(0) == batch && k.size(3) == dim, op, ": k_cache must be (", batch, ", H_kv, S, ", dim,
                  "), got ", k.sizes());
    } else {
      check_tensor(op, "block_table", *block_table, 2, q);
      TORCH_CHECK(block_table->scalar_type() == at::kInt, op, ": block_table must be int32, got ",
                  block_table->scalar_type());
      TORCH_CHECK(block_table->size(0) == batch, op, ": block_table must be (", batch, ", pages), got ",
                  block_table->sizes());
      TORCH_CHECK(v == nullptr, op, ": the paged split-KV pass reads no V");
      page_size = k.size(1);
      kv_heads = k.size(2);
      keys = block_table->size(1) * page_size;
      TORCH_CHECK(page_size > 0 && k.size(3) == dim, op, ": k_pages must be (pages, page_size, H_kv, ", dim,
                  "), got ", k.sizes());
      TORCH_CHECK(keys < (int64_t(1) << 31) && k.size(0) > 0 && k.size(0) < (int64_t(1) << 31), op,
                  ": need 1 <= page count < 2^31 and pages * page_size < 2^31, got k_pages ", k.sizes(),
                  " and block_table ", block_table->sizes());
    }
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
    TORCH_CHECK(group * dim_v <= kMaxVectorsTimesDimV, op, ": the cuda backend supports (H / H_kv) * D_v <= ",
                kMaxVectorsTimesDimV, ", got ", group, " * ", dim_v);
    if (batch == 0 || heads == 0) {
      policy = SplitPolicy{1, 1, 1, 0, 0};
      return;
    }
    sm_count = device_attribute(cudaDevAttrMultiProcessorCount, q);
    const int64_t limit = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, q);
    const int64_t smem_per_sm = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, q);
    // The fastest kernel that takes the shape and whose block fits this GPU's shared memory (SplitKernel): on
    // GPUs with 99 KB a block (sm_86, sm_89) the tensor-core kernel's block at D 128 with V does not, and
    // decode_attention runs the pipelined one there. The tensor-core kernel's m16n8k16 MMA and ldmatrix need sm_80
    // (its device code traps below).
    if (mma_fits(group, dim, dim_v, v != nullptr, vectorized, q.element_size()) &&
        device_attribute(cudaDevAttrComputeCapabilityMajor, q) >= 8) {
      policy = mma_policy(batch, heads, kv_heads, rows, keys, dim, v != nullptr, sm_count, smem_per_sm);
    }
    if ((policy.kernel == SplitKernel::kGeneral || int64_t(policy.smem_bytes) > limit) &&
        pipelined_fits(group, dim, dim_v, v != nullptr, vectorized, q.element_size())) {
      policy = pipelined_policy(batch, heads, kv_heads, rows, keys, dim, dim_v, v != nullptr, q.element_size(),
                                sm_count, smem_per_sm);
    }
    if (policy.kernel == SplitKernel::kGeneral || int64_t(policy.smem_bytes) > limit) {
      policy = split_policy(batch, heads, kv_heads, rows, keys, dim, dim_v, v != nullptr, sm_count);
    }
    TORCH_CHECK(int64_t(policy.smem_bytes) <= limit, op, ": a block of ", group, " query heads with D=", dim,
                ", D_v=", dim_v, " needs ", policy.smem_bytes, " bytes of shared memory; this GPU allows ", limit);
  }
};

// Regions of one float32 scratch tensor: reserved (sized) first, then allocated at once. Each region starts on a
// 64-byte boundary (16 floats; the allocation itself is aligned further), so 16-byte vector accesses stay aligned.
class Scratch {
 public:
  struct Region {
    const char* name;
    int64_t offset = -1;  // in floats; -1: not reserved
    size_t bytes = 0;
  };

  // `count` elements of `element_bytes` each, when `wanted`.
  Region reserve(const char* name, int64_t count, bool wanted = true, int64_t element_bytes = 4) {
    if (!wanted) return {name};
    const Region region{name, floats_, size_t(count * element_bytes)};
    floats_ += ceil_div(ceil_div(count * element_bytes, int64_t(4)), int64_t(16)) * 16;
    return region;
  }
  void allocate(const at::Tensor& like) { tensor_ = at::empty({floats_}, like.options().dtype(at::kFloat)); }
  // Null for a region not reserved or empty: the kernels test their optional outputs' pointers.
  float* floats(const Region& region) const {
    return region.offset < 0 || region.bytes == 0 ? nullptr : tensor_.data_ptr<float>() + region.offset;
  }
  NamedBuffers::Span named(const Region& region) const { return {region.name, floats(region), region.bytes}; }

 private:
  int64_t floats_ = 0;
  at::Tensor tensor_;
};

// The split-KV pass's float32 scratch and its launch, then head pooling of its scores when `pool.out` is
// set (pool/kernel.cuh's split_kv_pool). `v`, `lse_in`, `out` and `lse_out` may be null.
struct SplitRun {
  const char* op;
  const SplitShape& shape;
  const at::Tensor& q;
  const at::Tensor& k;
  const at::Tensor* v;
  Index start, input_end, end;
  double scale;
  const at::Tensor* lse_in;  // (B, H, R) float32 contiguous
  bool redistribute;
  at::Tensor* out;      // (B, H, [R,] D_v) in q's dtype, contiguous
  at::Tensor* lse_out;  // (B, H, [R]) float32, contiguous
  PoolTail pool;        // pool.out null: no pooling; pool.stats is allocated here
  const at::Tensor* block_table = nullptr;  // (B, pages) int32 when k holds pages (shape.page_size > 0)
  const VariantArgs* variant = nullptr;     // the softcap and sinks (pool.score_start holds the columns' start)

  void launch() {
    const SplitPolicy& policy = shape.policy;
    const int64_t query_rows = shape.batch * shape.heads * shape.rows;
    // The tensor-core kernel keeps the log c update's scores as fp16 relative to group maxima (SplitParams): half
    // the bytes, log p to 2^-11 of itself, within 16-bit inputs' tolerance; m' out keeps float32 scores.
    const bool pooled = pool.out != nullptr;
    const bool relative = pooled && policy.kernel == SplitKernel::kMma && pool.epilogue == PoolEpilogue::kAddLogFloor;
    // All the pass's scratch in one float32 allocation (each costs host time on a GPU), regions 64-byte aligned:
    // the splits' partials (B, H, R, splits, 4) and (B, H, R, splits, D_v), the input keys' scores (B, H, R, S) as
    // float32, or fp16 in rows padded to 16 keys with their maxima (B, H, R, ceil(S / 16)), and head pooling's
    // (B, H, R, 2) stats.
    Scratch scratch;
    const Scratch::Region part_stats = scratch.reserve("part_stats", query_rows * policy.splits * 4);
    const Scratch::Region part_acc = scratch.reserve("part_acc", query_rows * policy.splits * shape.dim_v, v != nullptr);
    const Scratch::Region scores = scratch.reserve("scores", query_rows * shape.keys, pooled && !relative);
    const Scratch::Region relative_scores =
        scratch.reserve("relative_scores", query_rows * relative_score_stride(shape.keys), relative, 2);
    const Scratch::Region score_maxima =
        scratch.reserve("score_maxima", query_rows * ceil_div(shape.keys, kRelativeScoreGroup), relative);
    const Scratch::Region stats = scratch.reserve("stats", query_rows * 2, pooled);
    scratch.allocate(q);
    const NamedBuffers named({scratch.named(part_stats), scratch.named(part_acc), scratch.named(scores),
                              scratch.named(relative_scores), scratch.named(score_maxima), scratch.named(stats)});
    if (pooled) {
      pool.stats = scratch.floats(stats);
      pool.sm_count = shape.sm_count;
    }
    const double softcap = variant == nullptr ? 0.0 : variant->softcap;
    const c10::cuda::CUDAGuard guard(q.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    dispatch_float(op, q.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const bool four_dims = q.dim() == 4, paged = block_table != nullptr;
      const SplitParams<T> p{
          pointer<T>(q), q.stride(0), q.stride(1), four_dims ? q.stride(2) : 0,
          pointer<T>(k), k.stride(0), k.stride(paged ? 2 : 1), k.stride(paged ? 1 : 2),
          v == nullptr ? nullptr : pointer<T>(*v),
          v == nullptr ? 0 : v->stride(0),
          v == nullptr ? 0 : v->stride(1),
          v == nullptr ? 0 : v->stride(2),
          paged ? block_table->data_ptr<int32_t>() : nullptr, paged ? block_table->stride(0) : 0, shape.page_size,
          paged ? k.size(0) : 0,
          start, input_end, end, float(scale * double(kLog2e)),
          softcap > 0.0 ? float(scale / softcap) : 0.0f, float(softcap * double(kLog2e)),
          shape.batch, shape.heads, shape.kv_heads, shape.rows, shape.keys, shape.dim, shape.dim_v,
          policy.splits, policy.rows_per_block,
          scratch.floats(part_stats), scratch.floats(part_acc), scratch.floats(scores), policy.tile_keys,
          policy.key_groups, reinterpret_cast<__half*>(scratch.floats(relative_scores)), scratch.floats(score_maxima),
      };
      const CombineParams<T> combine{
          scratch.floats(part_stats), scratch.floats(part_acc), shape.heads * shape.rows, policy.splits, shape.dim_v,
          shape.rows, variant == nullptr || !variant->sinks.defined() ? nullptr : variant->sinks.data_ptr<float>(),
          lse_in == nullptr ? nullptr : lse_in->data_ptr<float>(), redistribute, scratch.floats(stats),
          lse_out == nullptr ? nullptr : lse_out->data_ptr<float>(),
          out == nullptr ? nullptr : reinterpret_cast<T*>(out->data_ptr()),
      };
      const cudaError_t error =
          v == nullptr ? split_kv_pool<T, false>(p, combine, pool, policy.kernel, shape.vectorized, stream)
                       : split_kv_pool<T, true>(p, combine, pool, policy.kernel, shape.vectorized, stream);
      check_launch(op, error);
    });
  }
};

}  // namespace macs

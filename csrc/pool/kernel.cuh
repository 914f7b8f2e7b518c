// Head pooling, the step every MACS op ends with: m'[i] = pool over heads of (p[h, start + i] + the
// head's mass on generated keys / N), then either the layer's floor term added to log_c or m' stored.
//
// Pooling needs all H heads of a key, so it runs after the rows (or the split-KV pass's scores and their
// per-row log-sum-exp) are complete: one thread per input key loops over the heads; consecutive threads
// read consecutive keys of a head's row. Grid (ceil(N_max / kPoolThreads), R, B). A thread loads kPoolHeadChunk
// heads' values before it uses any: the loop is bound by memory latency, one DRAM round trip per chunk, where each
// load consumed before the next was issued (a branch on whether the key is seen kept them apart) made 32 round trips
// for 32 heads (every cuda fused pass took 12-78 us over its attention on an H200; how much of that this was, a GPU
// run of the kernels preset says).
#pragma once

#include "split_kv/kernel.cuh"

namespace macs {

constexpr int kPoolThreads = 256;
constexpr int kPoolHeadChunk = 8;

enum class PoolEpilogue : int {
  kAddLogFloor = 0,  // out is log_c (B, N_max), R == 1: out[i] += log(alpha * max(m'[i], 0) + 1 - alpha)
  kStore = 1,        // out is (B, R, N_max): out[i] = m'[i] for i < N, 0 after
};

template <typename Src>
struct PoolParams {
  // Rows (B, H, [R,] S); with FROM_SCORES the split-KV pass's base-2 scores: float32, or fp16 relative to
  // `maxima` (SplitParams::relative_scores).
  const Src* values;
  int64_t stride_b, stride_h, stride_r;
  // (B, H, R, 2) per query row: the base-2 log-sum-exp that normalises its scores (unused for rows), and
  // its attention mass on generated keys (0 without redistribution).
  const float* stats;
  float* out;  // contiguous, see PoolEpilogue
  int64_t n_max, heads, rows, keys;
  Index start, input_end, end;
  float alpha;
  Pooling pooling;
  PoolEpilogue epilogue;
  // Where each row's N input columns start when not at `start` (a sliding-window row attends from its
  // window's start; the inputs before it get 0, and may precede slot 0): (B, [R]) key slots, or null data.
  Index score_start{nullptr, 0, 0};
  const float* maxima = nullptr;  // (B, H, R, ceil(S / kRelativeScoreGroup)) with fp16 relative scores
};

template <typename Src, bool FROM_SCORES>
__global__ void __launch_bounds__(kPoolThreads) pool_kernel(PoolParams<Src> p) {
  const int64_t r = blockIdx.y, b = blockIdx.z;
  const KeyRange range(p.start, p.input_end, p.end, b, r, p.keys);
  int64_t column0 = range.start, inputs_end = range.input_end;
  if (p.score_start.data != nullptr) {
    // The range clamps input_end into the attended keys; the inputs may all lie before them.
    column0 = min(p.score_start(b, r), range.start);
    inputs_end = min(max(p.input_end(b, r), column0), range.end);
  }
  const int64_t n_input = inputs_end - column0;

  // [heads][2] of this query row: the base-2 log-sum-exp its scores are normalised by, then its mass on generated
  // keys spread over the N inputs (computed once here, the same float division every key made before).
  extern __shared__ float stats[];
  for (int64_t i = threadIdx.x; i < 2 * p.heads; i += blockDim.x) {
    const float stat = p.stats[((b * p.heads + i / 2) * p.rows + r) * 2 + i % 2];
    stats[i] = i % 2 == 0 ? stat : stat / float(n_input);
  }
  __syncthreads();

  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  float* out = p.out + (b * p.rows + r) * p.n_max + i;
  if (i >= p.n_max) return;
  if (i >= n_input) {
    if (p.epilogue == PoolEpilogue::kStore) *out = 0.0f;
    return;
  }

  // An input before the attended start is unseen by this row: probability 0, and its slot is not read (an unchecked
  // range may put the attended start at the end of the cache).
  const bool seen = column0 + i >= range.start;
  const int64_t key = seen ? column0 + i : range.start;
  const Src* column = p.values + b * p.stride_b + r * p.stride_r + key;
  constexpr bool kRelative = FROM_SCORES && std::is_same_v<Src, __half>;
  const int64_t groups = ceil_div(p.keys, kRelativeScoreGroup);  // per row of maxima
  const float* maxima =
      kRelative ? p.maxima + (b * p.heads * p.rows + r) * groups + key / kRelativeScoreGroup : nullptr;
  // Loaded with the heads, not after them: each load is a DRAM or L2 round trip.
  const float previous = p.epilogue == PoolEpilogue::kAddLogFloor ? *out : 0.0f;
  float pooled = p.pooling == Pooling::kMax ? kNegInf : (p.pooling == Pooling::kMin ? kInf : 0.0f);
  // Head h's loaded value (and, with relative scores, its maximum) into the pool.
  const auto pool_head = [&](int64_t h, float loaded, float maximum) {
    float value = 0.0f;
    if (seen) {
      value = loaded;
      if constexpr (kRelative) {
        value = exp2_diff(value, stats[2 * h] - maximum);
      } else if (FROM_SCORES) {
        value = exp2_diff(value, stats[2 * h]);
      }
    }
    value += stats[2 * h + 1];
    pooled = p.pooling == Pooling::kMax ? fmaxf(pooled, value)
             : p.pooling == Pooling::kMin ? fminf(pooled, value)
                                          : pooled + value;
  };
  const auto maximum_of = [&](int64_t h) { return kRelative ? maxima[h * p.rows * groups] : 0.0f; };
  // A seen key's heads in whole chunks of unconditional loads (a predicated or clamped tail load made the compiler
  // wait for the first load, or read a head twice), then the heads left one by one; an unseen key's without loads.
  int64_t h0 = 0;
  for (; seen && h0 + kPoolHeadChunk <= p.heads; h0 += kPoolHeadChunk) {
    float loaded[kPoolHeadChunk], maximum[kPoolHeadChunk];
#pragma unroll
    for (int j = 0; j < kPoolHeadChunk; ++j) {
      loaded[j] = to_float(column[(h0 + j) * p.stride_h]);
      maximum[j] = maximum_of(h0 + j);
    }
#pragma unroll
    for (int j = 0; j < kPoolHeadChunk; ++j) pool_head(h0 + j, loaded[j], maximum[j]);
  }
  for (; h0 < p.heads; ++h0) {
    pool_head(h0, seen ? to_float(column[h0 * p.stride_h]) : 0.0f, seen ? maximum_of(h0) : 0.0f);
  }
  if (p.pooling == Pooling::kMean) pooled /= float(p.heads);
  if (p.epilogue == PoolEpilogue::kStore) {
    *out = pooled;
  } else {
    // Efficient-attention rows can pool below zero; clamping keeps the floor's log defined.
    *out = previous + logf(p.alpha * fmaxf(pooled, 0.0f) + (1.0f - p.alpha));
  }
}

// Launches pool_kernel on `stream` (instantiated in kernel.cu for the rows' dtypes, and for float32
// scores).
template <typename Src, bool FROM_SCORES>
cudaError_t pool_heads(const PoolParams<Src>& p, int64_t batch, cudaStream_t stream);

// What follows a split-KV pass when the op pools its scores: `out` null for plain attention.
struct PoolTail {
  float* out;
  int64_t n_max;
  float alpha;
  Pooling pooling;
  PoolEpilogue epilogue;
  float* stats;  // scratch (B, H, R, 2), filled by the combine pass
  Index score_start{nullptr, 0, 0};  // see PoolParams
};

// The split-KV pass (split_kv/kernel.cuh), then head pooling of its scores into tail.out: decode_attention,
// macs_update and macs_pool all run this one composition.
template <typename T, bool WITH_V>
cudaError_t split_kv_pool(const SplitParams<T>& p, const CombineParams<T>& combine, const PoolTail& tail,
                          SplitKernel kernel, bool vectorized, cudaStream_t stream);

}  // namespace macs

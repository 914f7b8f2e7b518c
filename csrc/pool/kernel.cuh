// Head pooling, the step every MACS op ends with: m'[i] = pool over heads of (p[h, start + i] + the
// head's mass on generated keys / N), then either the layer's floor term added to log_c or m' stored.
//
// Pooling needs all H heads of a key, so it runs after the rows (or the split-KV pass's scores and their
// per-row log-sum-exp) are complete: SLICES threads per input key (pool_head_slices) each loop over a slice of
// its heads, then the first combines their partial pools; consecutive threads read consecutive keys of a head's row.
// Grid (ceil(N_max * SLICES / kPoolThreads), R, B). A thread loads kPoolHeadChunk heads' values before it uses
// any: the loop is bound by memory latency, one DRAM round trip per chunk, where each load consumed before the next
// was issued (a branch on whether the key is seen kept them apart) made 32 round trips for 32 heads.
#pragma once

#include "split_kv/kernel.cuh"

namespace macs {

constexpr int kPoolThreads = 256;
constexpr int kPoolHeadChunk = 8;
constexpr int kPoolMaxHeadSlices = 4;
// The most threads an sm_80 or sm_90 multiprocessor keeps resident.
constexpr int64_t kResidentThreadsPerSM = 2048;

// Threads that pool one key's heads together: 1, 2 or 4. A thread's heads are a chain of dependent round trips
// (the stats, log c, then one a chunk of heads), and a grid of one thread per key fills an H200 only from about
// 270k (B * R * N) keys: at 1 x 32k keys and 32 heads the pool ran 7.3 us, 128 blocks each waiting on its chains
// (ncu, 64cce54). Below a full complement of resident threads the heads are split further, each slice keeping a
// whole chunk of loads.
inline int pool_head_slices(int64_t keys_in_grid, int64_t heads, int64_t sm_count) {
  int slices = 1;
  while (slices < kPoolMaxHeadSlices && keys_in_grid * slices < sm_count * kResidentThreadsPerSM &&
         heads >= 2 * slices * kPoolHeadChunk) {
    slices *= 2;
  }
  return slices;
}

enum class PoolEpilogue : int {
  kAddLogFloor = 0,  // out is log_c (B, N_max), R == 1: out[i] += log(alpha * max(m'[i], 0) + 1 - alpha)
  kStore = 1,        // out is (B, R, N_max): out[i] = m'[i] for i < N, 0 after
};

template <typename Src>
struct PoolParams {
  // Rows (B, H, [R,] S); with FROM_SCORES the split-KV pass's base-2 scores: float32, or fp16 relative to
  // `maxima` (SplitParams::relative_scores, in its padded rows and slot order).
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

template <typename Src, bool FROM_SCORES, int SLICES>
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

  constexpr int kKeysPerBlock = kPoolThreads / SLICES;
  const int slice = SLICES == 1 ? 0 : int(threadIdx.x) / kKeysPerBlock;
  const int64_t i = blockIdx.x * int64_t(kKeysPerBlock) + int(threadIdx.x) % kKeysPerBlock;
  float* out = p.out + (b * p.rows + r) * p.n_max + i;
  const bool input = i < n_input && i < p.n_max;
  // Loaded first, with the ranges (each load is a DRAM or L2 round trip): log c was written before the split pass
  // began, so a programmatic dependent reads it before its wait.
  const float previous = input && slice == 0 && p.epilogue == PoolEpilogue::kAddLogFloor ? *out : 0.0f;
  // As the combine's programmatic dependent (split_kv_pool, kernel.cu), the stats, scores and maxima the split pass
  // wrote are read after this.
  wait_for_prior_grid();

  // [heads][2] of this query row: the base-2 log-sum-exp its scores are normalised by, then its mass on generated
  // keys spread over the N inputs (computed once here, the same float division every key made before); then, with
  // head slices, each thread's partial pool.
  extern __shared__ float shared[];
  float* stats = shared;
  for (int64_t h = threadIdx.x; h < 2 * p.heads; h += blockDim.x) {
    const float stat = p.stats[((b * p.heads + h / 2) * p.rows + r) * 2 + h % 2];
    stats[h] = h % 2 == 0 ? stat : stat / float(n_input);
  }
  __syncthreads();

  const auto store_past_inputs = [&] {
    if (i < p.n_max && p.epilogue == PoolEpilogue::kStore) *out = 0.0f;
  };
  if constexpr (SLICES == 1) {
    if (!input) return store_past_inputs();
  }
  // This thread's heads [head_begin, head_end): whole chunks (a slice's heads past its chunks take a round trip
  // each: 24 heads as 12 and 12 would chain 5, as 16 and 8 chain 2).
  const int64_t slice_heads = ceil_div(ceil_div(p.heads, kPoolHeadChunk), SLICES) * kPoolHeadChunk;
  const int64_t head_begin = slice * slice_heads;
  const int64_t head_end = SLICES == 1 ? p.heads : min(p.heads, head_begin + slice_heads);

  // An input before the attended start is unseen by this row: probability 0, and its slot is not read (an unchecked
  // range may put the attended start at the end of the cache).
  const bool seen = input && column0 + i >= range.start;
  const int64_t key = seen ? column0 + i : range.start;
  constexpr bool kRelative = FROM_SCORES && std::is_same_v<Src, __half>;
  const Src* column = p.values + b * p.stride_b + r * p.stride_r + (kRelative ? relative_score_slot(key) : key);
  const int64_t groups = ceil_div(p.keys, kRelativeScoreGroup);  // per row of maxima
  const float* maxima =
      kRelative ? p.maxima + (b * p.heads * p.rows + r) * groups + key / kRelativeScoreGroup : nullptr;
  float pooled = p.pooling == Pooling::kMax ? kNegInf : (p.pooling == Pooling::kMin ? kInf : 0.0f);
  const auto pool_value = [&](float value) {
    pooled = p.pooling == Pooling::kMax ? fmaxf(pooled, value)
             : p.pooling == Pooling::kMin ? fminf(pooled, value)
                                          : pooled + value;
  };
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
    pool_value(value + stats[2 * h + 1]);
  };
  const auto maximum_of = [&](int64_t h) { return kRelative ? maxima[h * p.rows * groups] : 0.0f; };
  // A seen key's heads in whole chunks of unconditional loads (a predicated or clamped tail load made the compiler
  // wait for the first load, or read a head twice), then the heads left one by one; an unseen key's without loads.
  // A chunk is pooled from its last load back: ptxas put uses of the first heads between the loads (7 of 8 in
  // flight, 1 to 9 of 16 with relative scores, by the instantiation), and nothing can use the last load before it
  // is issued.
  int64_t h0 = head_begin;
  for (; seen && h0 + kPoolHeadChunk <= head_end; h0 += kPoolHeadChunk) {
    float loaded[kPoolHeadChunk], maximum[kPoolHeadChunk];
#pragma unroll
    for (int j = 0; j < kPoolHeadChunk; ++j) maximum[j] = maximum_of(h0 + j);
#pragma unroll
    for (int j = 0; j < kPoolHeadChunk; ++j) loaded[j] = to_float(column[(h0 + j) * p.stride_h]);
#pragma unroll
    for (int j = kPoolHeadChunk - 1; j >= 0; --j) pool_head(h0 + j, loaded[j], maximum[j]);
  }
  for (; input && h0 < head_end; ++h0) {
    pool_head(h0, seen ? to_float(column[h0 * p.stride_h]) : 0.0f, seen ? maximum_of(h0) : 0.0f);
  }
  if constexpr (SLICES > 1) {
    // Every thread reaches the barrier, past the inputs too.
    float* partial = shared + 2 * p.heads;
    partial[threadIdx.x] = pooled;
    __syncthreads();
    if (slice != 0) return;
#pragma unroll
    for (int other = 1; other < SLICES; ++other) pool_value(partial[threadIdx.x + other * kKeysPerBlock]);
    if (!input) return store_past_inputs();
  }
  if (p.pooling == Pooling::kMean) pooled /= float(p.heads);
  if (p.epilogue == PoolEpilogue::kStore) {
    *out = pooled;
  } else {
    // Efficient-attention rows can pool below zero; clamping keeps the floor's log defined.
    *out = previous + logf(p.alpha * fmaxf(pooled, 0.0f) + (1.0f - p.alpha));
  }
}

// Launches pool_kernel on `stream` with the head slices pool_head_slices gives a GPU of `sm_count` multiprocessors
// (instantiated in kernel.cu for the rows' dtypes, and for float32 and fp16 relative scores); `dependent`: as the
// programmatic dependent of the kernel before it, which wrote what it reads (common.cuh, launch_kernel).
template <typename Src, bool FROM_SCORES>
cudaError_t pool_heads(const PoolParams<Src>& p, int64_t batch, int64_t sm_count, cudaStream_t stream,
                       bool dependent = false);

// What follows a split-KV pass when the op pools its scores: `out` null for plain attention.
struct PoolTail {
  float* out;
  int64_t n_max;
  float alpha;
  Pooling pooling;
  PoolEpilogue epilogue;
  float* stats;  // scratch (B, H, R, 2), filled by the combine pass
  Index score_start{nullptr, 0, 0};  // see PoolParams
  int64_t sm_count = 0;              // the GPU's multiprocessors (pool_head_slices)
};

// The split-KV pass (split_kv/kernel.cuh), then head pooling of its scores into tail.out: decode_attention,
// macs_update and macs_pool all run this one composition.
template <typename T, bool WITH_V>
cudaError_t split_kv_pool(const SplitParams<T>& p, const CombineParams<T>& combine, const PoolTail& tail,
                          SplitKernel kernel, bool vectorized, cudaStream_t stream);

}  // namespace macs

// Split-KV decode attention (flash-decoding), optionally fused with the MACS layer update.
//
// 1. split_kernel, grid (splits, H_kv, B): a block owns one KV head and one contiguous slice of a row's
//    attended keys. It stages tiles of 32 keys of K (and V) in shared memory with 16-byte loads, so each
//    key is read from memory once for the G query heads of the group, and keeps an online softmax per
//    head: the partial (max, sum) over all its keys and over its generated keys, and the unnormalised
//    partial output. With `scores`, it also writes the scaled float32 scores for the pooling kernel.
// 2. combine_kernel, grid (H, B): merges the splits into out and lse, and the per-head values pooling
//    needs: the normalising lse (given or computed) and the generated mass exp(lse_gen - lse).
// 3. pool_kernel (macs_update_rows/kernel.cuh) when the MACS update is asked for.
// macs_update runs the same three steps without V.
#pragma once

#include "common.cuh"
#include "macs_update_rows/kernel.cuh"

namespace macs {

constexpr int kTileKeys = 32;  // one key per lane in the per-head softmax step
constexpr int kMaxAccumulators = 16;  // output elements per thread: G * D_v <= threads * 16
constexpr int kMaxSplitThreads = 256;
constexpr int64_t kMaxGroupTimesDimV = int64_t(kMaxSplitThreads) * kMaxAccumulators;

template <typename T>
struct SplitParams {
  const T* q;  // (B, H, D)
  int64_t q_sb, q_sh;
  const T* k;  // (B, H_kv, S, D)
  int64_t k_sb, k_sh, k_ss;
  const T* v;  // (B, H_kv, S, D_v), null for macs_update
  int64_t v_sb, v_sh, v_ss;
  Index start, input_end, end;  // attended keys [start, end); generated keys [input_end, end)
  float scale;
  int64_t batch, heads, kv_heads, keys, dim, dim_v;
  int64_t splits;
  float* part_stats;  // (B, H, splits, 4): max and sum of exp over all keys, then over generated keys
  float* part_acc;    // (B, H, splits, D_v): sum of exp(score - split max) * v
  float* scores;      // (B, H, S) scaled scores of the attended keys, or null
};

// Odd row pitch: the 32 lanes of a warp read 32 different keys at the same d without bank conflicts.
__host__ __device__ inline int64_t key_pitch(int64_t dim) { return dim | 1; }

__host__ inline size_t split_smem_bytes(int64_t group, int64_t dim, int64_t dim_v, bool with_v) {
  const int64_t floats = group * dim + kTileKeys * key_pitch(dim) + (with_v ? kTileKeys * dim_v : 0) +
                         group * kTileKeys + 5 * group;
  return size_t(floats) * sizeof(float);
}

__host__ inline int split_threads(int64_t group, int64_t dim_v) {
  return group * dim_v <= 128 * kMaxAccumulators ? 128 : kMaxSplitThreads;
}

// Enough blocks to fill the GPU twice, each with at least one tile.
__host__ inline int64_t choose_splits(int64_t batch, int64_t kv_heads, int64_t keys, int64_t sm_count) {
  const int64_t wanted = ceil_div(2 * sm_count, batch * kv_heads);
  return wanted < 1 ? 1 : (wanted < ceil_div(keys, kTileKeys) ? wanted : ceil_div(keys, kTileKeys));
}

// Stages keys [tile, tile + kTileKeys) of one head as floats, rows at `pitch`; keys at or past `stop`
// become zeros (their probabilities are zero, and 0 * garbage could be NaN).
template <typename T, int VEC>
__device__ __forceinline__ void stage_tile(const T* __restrict__ base, int64_t key_stride, int64_t dim,
                                           int64_t tile, int64_t stop, float* tile_s, int64_t pitch) {
  // 32-bit index math: 64-bit division is emulated and would dominate this loop.
  const int chunks = int(dim / VEC);
  for (int c = threadIdx.x; c < kTileKeys * chunks; c += blockDim.x) {
    const int j = c / chunks, d0 = (c % chunks) * VEC;
    float values[VEC];
    if (tile + j < stop) {
      load_floats<T, VEC>(base + (tile + j) * key_stride + d0, values);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) values[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) tile_s[j * pitch + d0 + i] = values[i];
  }
}

template <typename T, int VEC, bool WITH_V>
__global__ void __launch_bounds__(kMaxSplitThreads) split_kernel(SplitParams<T> p) {
  extern __shared__ float smem[];
  const int64_t split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
  const int64_t group = p.heads / p.kv_heads, dim = p.dim, dim_v = p.dim_v, pitch = key_pitch(dim);
  float* q_s = smem;                                       // [group][dim]
  float* k_s = q_s + group * dim;                          // [kTileKeys][pitch]
  float* v_s = k_s + kTileKeys * pitch;                    // [kTileKeys][dim_v] when WITH_V
  float* p_s = v_s + (WITH_V ? kTileKeys * dim_v : 0);     // [group][kTileKeys]
  float* m_s = p_s + group * kTileKeys;                    // [group] running max, all keys
  float* l_s = m_s + group;                                // [group] running sum, all keys
  float* mg_s = l_s + group;                               // [group] running max, generated keys
  float* lg_s = mg_s + group;                              // [group] running sum, generated keys
  float* factor_s = lg_s + group;                          // [group] rescaling of the output this tile

  const int64_t head0 = kv_head * group;
  for (int i = threadIdx.x; i < group * dim; i += blockDim.x) {
    q_s[i] = to_float(p.q[b * p.q_sb + (head0 + i / int(dim)) * p.q_sh + i % int(dim)]);
  }
  for (int64_t g = threadIdx.x; g < group; g += blockDim.x) {
    m_s[g] = kNegInf;
    l_s[g] = 0.0f;
    mg_s[g] = kNegInf;
    lg_s[g] = 0.0f;
  }

  // This split's share of the row's attended keys, in whole tiles counted from `start`.
  const KeyRange range(p.start, p.input_end, p.end, b, p.keys);
  const int64_t tiles_per_split = ceil_div(ceil_div(range.end - range.start, kTileKeys), p.splits);
  const int64_t begin = range.start + split * tiles_per_split * kTileKeys;
  const int64_t stop = min(range.end, begin + tiles_per_split * kTileKeys);

  const T* k_head = p.k + b * p.k_sb + kv_head * p.k_sh;
  const T* v_head = WITH_V ? p.v + b * p.v_sb + kv_head * p.v_sh : nullptr;
  float* scores_out = p.scores == nullptr ? nullptr : p.scores + (b * p.heads + head0) * p.keys;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;

  float acc[kMaxAccumulators];
#pragma unroll
  for (int a = 0; a < kMaxAccumulators; ++a) acc[a] = 0.0f;

  for (int64_t tile = begin; tile < stop; tile += kTileKeys) {
    __syncthreads();  // the previous tile's shared memory is no longer read (and q_s is written)
    stage_tile<T, VEC>(k_head, p.k_ss, dim, tile, stop, k_s, pitch);
    if (WITH_V) stage_tile<T, VEC>(v_head, p.v_ss, dim_v, tile, stop, v_s, dim_v);
    __syncthreads();

    // Scores: a warp computes one head against the tile's 32 keys.
    for (int pair = threadIdx.x; pair < group * kTileKeys; pair += blockDim.x) {
      const int g = pair / kTileKeys, j = pair % kTileKeys;
      const float* q_row = q_s + g * dim;
      const float* k_row = k_s + j * pitch;
      float dot = 0.0f;
#pragma unroll 4
      for (int d = 0; d < int(dim); ++d) dot = fmaf(q_row[d], k_row[d], dot);
      const float score = tile + j < stop ? dot * p.scale : kNegInf;
      p_s[pair] = score;
      if (scores_out != nullptr && tile + j < stop) scores_out[g * p.keys + tile + j] = score;
    }
    __syncthreads();

    // Online softmax per head, one key per lane; p_s becomes exp(score - running max).
    for (int64_t g = warp; g < group; g += warps) {
      const float score = p_s[g * kTileKeys + lane];
      const float old_m = m_s[g], old_mg = mg_s[g];
      const float new_m = fmaxf(old_m, warp_max(score));
      const float weight = score == kNegInf ? 0.0f : expf(score - new_m);
      const float factor = old_m == kNegInf ? 0.0f : expf(old_m - new_m);
      const float tile_sum = warp_sum(weight);
      const float generated = tile + lane >= range.input_end ? score : kNegInf;
      const float new_mg = fmaxf(old_mg, warp_max(generated));
      const float generated_sum = warp_sum(generated == kNegInf ? 0.0f : expf(generated - new_mg));
      p_s[g * kTileKeys + lane] = weight;
      if (lane == 0) {
        m_s[g] = new_m;
        l_s[g] = l_s[g] * factor + tile_sum;
        lg_s[g] = (old_mg == kNegInf ? 0.0f : lg_s[g] * expf(old_mg - new_mg)) + generated_sum;
        mg_s[g] = new_mg;
        factor_s[g] = factor;
      }
    }

    if (WITH_V) {
      __syncthreads();
#pragma unroll
      for (int a = 0; a < kMaxAccumulators; ++a) {
          const int e = threadIdx.x + a * blockDim.x;
        if (e < group * dim_v) {
          const int g = e / int(dim_v), d = e % int(dim_v);
          const float* weights = p_s + g * kTileKeys;
          float sum = acc[a] * factor_s[g];
#pragma unroll 8
          for (int j = 0; j < kTileKeys; ++j) sum = fmaf(weights[j], v_s[j * dim_v + d], sum);
          acc[a] = sum;
        }
      }
    }
  }
  __syncthreads();

  const int64_t part = (b * p.heads + head0) * p.splits + split;  // head g adds g * splits
  for (int64_t g = threadIdx.x; g < group; g += blockDim.x) {
    float* stats = p.part_stats + (part + g * p.splits) * 4;
    stats[0] = m_s[g];
    stats[1] = l_s[g];
    stats[2] = mg_s[g];
    stats[3] = lg_s[g];
  }
  if (WITH_V) {
#pragma unroll
    for (int a = 0; a < kMaxAccumulators; ++a) {
      const int e = threadIdx.x + a * blockDim.x;
      if (e < group * dim_v) p.part_acc[(part + e / int(dim_v) * p.splits) * dim_v + e % int(dim_v)] = acc[a];
    }
  }
}

template <typename T>
struct CombineParams {
  const float* part_stats;
  const float* part_acc;  // null without V
  int64_t heads, splits, dim_v;
  const float* lse_in;  // (B, H) float32 contiguous, or null: normalise with the computed lse
  bool redistribute;
  float* stats;    // (B, H, 2) for pool_kernel, or null
  float* lse_out;  // (B, H) float32, or null
  T* out;          // (B, H, D_v) contiguous, or null
};

constexpr int kCombineThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(CombineParams<T> p) {
  const int64_t bh = blockIdx.y * p.heads + blockIdx.x;
  const float* part = p.part_stats + bh * p.splits * 4;
  SoftmaxState all{kNegInf, 0.0f}, generated{kNegInf, 0.0f};
  for (int64_t s = 0; s < p.splits; ++s) {
    all.merge(part[4 * s], part[4 * s + 1]);
    generated.merge(part[4 * s + 2], part[4 * s + 3]);
  }
  const float lse = all.lse();
  if (threadIdx.x == 0) {
    if (p.lse_out != nullptr) p.lse_out[bh] = lse;
    if (p.stats != nullptr) {
      const float norm = p.lse_in == nullptr ? lse : p.lse_in[bh];
      p.stats[2 * bh] = norm;
      p.stats[2 * bh + 1] =
          p.redistribute && generated.l > 0.0f ? generated.l * expf(generated.m - norm) : 0.0f;
    }
  }
  if (p.out == nullptr) return;
  const float inverse = all.l > 0.0f ? 1.0f / all.l : 0.0f;
  for (int64_t d = threadIdx.x; d < p.dim_v; d += blockDim.x) {
    float sum = 0.0f;
    for (int64_t s = 0; s < p.splits; ++s) {
      const float m = part[4 * s];
      if (m != kNegInf) sum += expf(m - all.m) * p.part_acc[(bh * p.splits + s) * p.dim_v + d];
    }
    p.out[bh * p.dim_v + d] = from_float<T>(sum * inverse);
  }
}

// The MACS update that follows the split pass: pool the scores into log_c.
struct PoolTail {
  float* log_c;  // (B, N_max) contiguous, or null for plain attention
  int64_t n_max;
  float alpha;
  Pooling pooling;
  float* stats;  // scratch (B, H, 2), filled by the combine pass
};

// Runs the split and combine passes, then pooling when tail.log_c is set. `vectorized`: K and V rows
// start on 16-byte boundaries and D, D_v are multiples of 16 bytes.
template <typename T, bool WITH_V>
cudaError_t split_combine_pool(const SplitParams<T>& p, const CombineParams<T>& combine, const PoolTail& tail,
                               bool vectorized, cudaStream_t stream) {
  const int64_t group = p.heads / p.kv_heads;
  const size_t smem = split_smem_bytes(group, p.dim, p.dim_v, WITH_V);
  const dim3 grid(unsigned(p.splits), unsigned(p.kv_heads), unsigned(p.batch));
  const int threads = split_threads(group, WITH_V ? p.dim_v : 0);
  const auto kernel = vectorized ? split_kernel<T, kVec16<T>, WITH_V> : split_kernel<T, 1, WITH_V>;
  if (smem > 48 * 1024) {
    const cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (error != cudaSuccess) return error;
  }
  kernel<<<grid, threads, smem, stream>>>(p);
  combine_kernel<T><<<dim3(unsigned(p.heads), unsigned(p.batch)), kCombineThreads, 0, stream>>>(combine);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess || tail.log_c == nullptr) return error;
  const PoolParams<float> pool{p.scores, p.heads * p.keys, p.keys,       tail.stats,  tail.log_c,
                               tail.n_max, p.heads,        p.keys,       p.start,     p.input_end,
                               p.end,      tail.alpha,     tail.pooling};
  return launch_pool<float, true>(pool, p.batch, stream);
}

template <typename T>
cudaError_t decode_attention(const SplitParams<T>& p, const CombineParams<T>& combine, const PoolTail& tail,
                             bool vectorized, cudaStream_t stream) {
  return split_combine_pool<T, true>(p, combine, tail, vectorized, stream);
}

#define MACS_DECLARE_DECODE(T)                                                                        \
  extern template cudaError_t decode_attention<T>(const SplitParams<T>&, const CombineParams<T>&,   \
                                                  const PoolTail&, bool, cudaStream_t);
MACS_DECLARE_DECODE(float)
MACS_DECLARE_DECODE(__half)
MACS_DECLARE_DECODE(__nv_bfloat16)
#undef MACS_DECLARE_DECODE

}  // namespace macs

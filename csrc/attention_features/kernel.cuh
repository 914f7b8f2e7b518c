// AT2 features: per query head, the softmax attention of R target rows on a span of source keys, summed
// over the rows. Valid row r (< n_rows[b]) attends keys [kv_start, kv_len - n_rows + r + 1).
//
// features_lse_kernel (only without a given lse): one block per (b, h, kFeatureWarps rows), one warp per row. The
// rows' keys pass through shared memory a tile of 32 at a time, read once (and coalesced) for all the block's rows;
// lane j scores key j into an online log-sum-exp, merged across the warp at the end.
// features_kernel: one block per (b, h, tile of 32 source keys). The tile's keys sit in shared memory
// (float, rows padded by one against bank conflicts); each warp takes one target row at a time, lane j
// scores key j, and keeps its column's running sum over rows in a register; the warps' sums are added
// at the end. Rows whose causal window ends before the tile are skipped.
//
// Attention variants (macs_kernels/ops/variant.py): row r attends from max(kv_start, base + r + 1 - window) (no
// window: one longer than the cache); with cap_in > 0 each score is capped to softcap * tanh(s / softcap)
// before it is read; sinks (H,) join each row's log-sum-exp. Rows whose window starts after the tile are
// skipped too.
#pragma once

#include "split_kv/state.cuh"

namespace macs {

constexpr int kFeatureTile = 32;   // source keys per block: one per lane
constexpr int kFeatureWarps = 8;   // rows scored at once
constexpr int kFeatureMaxDim = 256;

template <typename T>
struct FeaturesParams {
  const T* q;  // (B, H, R, D), unit last stride
  int64_t q_sb, q_sh, q_sr;
  const T* k;  // (B, H_kv, S, D), unit last stride
  int64_t k_sb, k_sh, k_ss;
  float* lse;  // (B, H, R) contiguous: read by features_kernel, written by features_lse_kernel
  Index source_start, source_end, kv_start, kv_len, n_rows;
  float scale_log2;  // the softmax scale times log2(e): scores are base 2 (split_kv/state.cuh)
  int64_t batch, heads, group, rows, dim, keys, n_max;
  float* out;  // (B, H, N_max) contiguous
  int64_t window;        // a sliding window in tokens; no window: keys + 1
  float cap_in, cap_out;  // cap_in > 0: score = cap_out * tanh(q . k * cap_in), base 2 (split_kv/kernel.cuh)
  const float* sinks;    // (H,) natural-log sink logits in each row's denominator, or null
};

// A row's base-2 score from its dot product q . k (the layer's softcap applied).
template <typename T>
__device__ __forceinline__ float feature_score(const FeaturesParams<T>& p, float dot) {
  return p.cap_in > 0.0f ? p.cap_out * tanhf(dot * p.cap_in) : dot * p.scale_log2;
}

// Row geometry of item b, clamped into the cache (the public op validates; clamping keeps direct
// torch.ops calls with bad indices in bounds).
struct FeatureRows {
  int64_t start, n_rows, base;  // row r's keys: [start, base + r + 1)
  __device__ __forceinline__ FeatureRows(const Index& kv_start, const Index& kv_len, const Index& n_rows_,
                                         int64_t b, int64_t rows, int64_t keys) {
    const int64_t end = min(max(kv_len(b), int64_t(0)), keys);
    n_rows = min(max(n_rows_(b), int64_t(0)), min(rows, end));
    base = end - n_rows;
    start = min(max(kv_start(b), int64_t(0)), base);
  }
};

template <typename T>
__global__ void __launch_bounds__(kFeatureWarps * 32) features_lse_kernel(FeaturesParams<T> p) {
  __shared__ float k_tile[kFeatureTile][kFeatureMaxDim + 1];
  __shared__ float q_rows[kFeatureWarps][kFeatureMaxDim];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t bh = blockIdx.x, b = bh / p.heads, h = bh % p.heads;
  const int64_t first_row = int64_t(blockIdx.y) * kFeatureWarps, r = first_row + warp;
  const FeatureRows rows(p.kv_start, p.kv_len, p.n_rows, b, p.rows, p.keys);
  if (r < p.rows && r >= rows.n_rows && lane == 0) p.lse[bh * p.rows + r] = 0.0f;
  const bool valid = r < rows.n_rows;  // the same for every lane of the warp
  if (valid) {
    const T* q = p.q + b * p.q_sb + h * p.q_sh + r * p.q_sr;
    for (int64_t d = lane; d < p.dim; d += 32) q_rows[warp][d] = to_float(q[d]);
  }
  // Row r attends [max(start, base + r + 1 - window), base + r + 1): the block's first row starts first, its last
  // valid row ends last.
  const int64_t row_lo = max(rows.start, rows.base + r + 1 - p.window), row_hi = rows.base + r + 1;
  const int64_t lo = max(rows.start, rows.base + first_row + 1 - p.window);
  const int64_t hi = first_row < rows.n_rows ? rows.base + min(first_row + kFeatureWarps, rows.n_rows) : lo;
  const T* k = p.k + b * p.k_sb + (h / p.group) * p.k_sh;
  SoftmaxState state;
  for (int64_t tile = lo; tile < hi; tile += kFeatureTile) {
    const int64_t tile_keys = min(int64_t(kFeatureTile), hi - tile);
    __syncthreads();  // the previous tile is no longer read (and, the first time, q_rows are written)
    for (int64_t i = threadIdx.x; i < tile_keys * p.dim; i += blockDim.x) {
      const int64_t j = i / p.dim, d = i % p.dim;
      k_tile[j][d] = to_float(k[(tile + j) * p.k_ss + d]);
    }
    __syncthreads();
    const int64_t n = tile + lane;
    if (valid && lane < tile_keys && n >= row_lo && n < row_hi) {
      float dot = 0.0f;
      for (int64_t d = 0; d < p.dim; ++d) dot = fmaf(q_rows[warp][d], k_tile[lane][d], dot);
      state.merge(feature_score(p, dot), 1.0f);
    }
  }
  if (!valid) return;
  state.merge_warp();
  if (p.sinks != nullptr) state.merge(p.sinks[h] * kLog2e, 1.0f);
  if (lane == 0) p.lse[bh * p.rows + r] = state.lse();
}

template <typename T>
__global__ void __launch_bounds__(kFeatureWarps * 32) features_kernel(FeaturesParams<T> p) {
  __shared__ float k_tile[kFeatureTile][kFeatureMaxDim + 1];
  __shared__ float q_rows[kFeatureWarps][kFeatureMaxDim];
  __shared__ float sums[kFeatureWarps][kFeatureTile];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t bh = blockIdx.x, b = bh / p.heads, h = bh % p.heads;
  const FeatureRows rows(p.kv_start, p.kv_len, p.n_rows, b, p.rows, p.keys);
  const int64_t source_end = min(max(p.source_end(b), int64_t(0)), p.keys);
  const int64_t first_key = p.source_start(b) + int64_t(blockIdx.y) * kFeatureTile;
  const int64_t tile_keys = max(min(int64_t(kFeatureTile), source_end - first_key), int64_t(0));

  const T* k = p.k + b * p.k_sb + (h / p.group) * p.k_sh;
  for (int64_t i = threadIdx.x; i < tile_keys * p.dim; i += blockDim.x) {
    const int64_t j = i / p.dim, d = i % p.dim;
    // A source before slot 0 comes only from an unchecked range: read as 0, never from before the cache.
    k_tile[j][d] = first_key + j >= 0 ? to_float(k[(first_key + j) * p.k_ss + d]) : 0.0f;
  }
  __syncthreads();

  const int64_t key = first_key + lane;
  float acc = 0.0f;
  // Row r sees key n when base + r - window < n <= base + r.
  const int64_t last_row = min(rows.n_rows, first_key + tile_keys - 1 - rows.base + p.window);
  for (int64_t r = max(first_key - rows.base, int64_t(0)) + warp; r < last_row; r += kFeatureWarps) {
    const T* q = p.q + b * p.q_sb + h * p.q_sh + r * p.q_sr;
    __syncwarp();
    for (int64_t d = lane; d < p.dim; d += 32) q_rows[warp][d] = to_float(q[d]);
    __syncwarp();
    if (lane < tile_keys && key >= 0 && key <= rows.base + r && key > rows.base + r - p.window) {
      float s = 0.0f;
      for (int64_t d = 0; d < p.dim; ++d) s = fmaf(q_rows[warp][d], k_tile[lane][d], s);
      acc += exp2f(feature_score(p, s) - p.lse[bh * p.rows + r] * kLog2e);
    }
  }
  sums[warp][lane] = acc;
  __syncthreads();
  if (warp == 0) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kFeatureWarps; ++w) total += sums[w][lane];
    const int64_t column = int64_t(blockIdx.y) * kFeatureTile + lane;
    if (column < p.n_max) p.out[bh * p.n_max + column] = lane < tile_keys ? total : 0.0f;
  }
}

// lse pass when compute_lse, then the features pass, on `stream`.
template <typename T>
cudaError_t attention_features(const FeaturesParams<T>& p, bool compute_lse, cudaStream_t stream);

}  // namespace macs

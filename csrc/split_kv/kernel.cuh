// The split-KV pass (flash-decoding) that decode_attention, macs_update and macs_pool share.
//
// 1. split_kernel, grid (splits, H_kv * row_chunks, B): a block owns one KV head, a chunk of the query
//    rows of sequence b (each row with every query head of that KV head: the block's "vectors") and one
//    contiguous slice of the keys those rows attend. It stages tiles of K (and V) in shared memory with
//    16-byte loads, so each key is read from memory once for all the block's vectors, and keeps an online
//    softmax per vector (state.cuh): the partial state over its attended keys and over its generated
//    keys, and the unnormalised partial output. With `scores`, it also writes the base-2 scores for head
//    pooling (pool/kernel.cuh). SOFTCAP (a layer's attention variant, Gemma 2) caps each score to
//    softcap * tanh(s / softcap) before anything reads it.
// 2. combine_kernel, grid (H * R, B): merges the splits of each query row into out and lse, and the
//    values head pooling needs: the normalising lse (given or computed) and the mass on generated keys.
//    With per-head sink logits (gpt-oss), each sink joins its rows' denominator and attends no value.
// split_kv_pipelined/kernel.cuh's pipelined_split_kernel and split_kv_mma/kernel.cuh's mma_split_kernel are
// faster rewrites of pass 1 for the shapes they take (SplitKernel in policy.cuh), writing the same partials; pass 2
// and head pooling serve all three.
// Row (b, r) attends keys [start, end) of item b; [input_end, end) are its generated keys (a sliding-window
// row attends from its window's start: its pooled columns may start earlier, see pool/kernel.cuh). The keys of
// an item are contiguous (B, H_kv, S, D) or in pages (P, page_size, H_kv, D) found through a block table.
#pragma once

#include "split_kv/policy.cuh"
#include "split_kv/state.cuh"

namespace macs {

// Keys per stored maximum of mma_split_kernel's relative scores (SplitParams::relative_scores).
constexpr int kRelativeScoreGroup = 16;

// Relative scores sit in rows padded to whole groups, each group's keys in the order mma_split_kernel's lanes hold
// them: key 8 n + 2 t + i of a group (n8 tile n, quad position t, pair element i) at slot 4 t + 2 n + i, so that a
// lane stores its 4 scores of a row in one 8-byte store. Stored key by key, a row's 32-byte sector took 4 stores of 2
// bytes from 4 lanes each (ncu at 8 x 32k keys: the fused pass's split kernel 28 us over its attention's, with its
// DRAM writes only the 18 MB the scores are).
static_assert(kRelativeScoreGroup == 16, "the slot order below is a group of two n8 tiles");
__host__ __device__ inline int64_t relative_score_stride(int64_t keys) {
  return ceil_div(keys, kRelativeScoreGroup) * kRelativeScoreGroup;
}
__host__ __device__ inline int64_t relative_score_slot(int64_t key) {
  const int64_t k = key % kRelativeScoreGroup;
  return key - k + ((k >> 1) & 3) * 4 + (k >> 3) * 2 + (k & 1);
}

template <typename T>
struct SplitParams {
  const T* q;  // (B, H, R, D)
  int64_t q_sb, q_sh, q_sr;
  const T* k;  // (B, H_kv, S, D), or pages (P, page_size, H_kv, D) with a block table
  int64_t k_sb, k_sh, k_ss;  // item (or page), head and key (or slot) strides
  const T* v;  // laid out like k with D_v, null without V
  int64_t v_sb, v_sh, v_ss;
  const int32_t* block_table;  // (B, pages): key j of item b is in page table[b, j / page_size]; or null
  int64_t table_stride, page_size, page_count;
  Index start, input_end, end;  // (B,) or (B, R)
  float scale_log2;             // the softmax scale times log2(e)
  float cap_in, cap_out;        // with SOFTCAP: score = cap_out * tanh(q . k * cap_in), base 2
  int64_t batch, heads, kv_heads, rows, keys, dim, dim_v;
  int64_t splits, rows_per_block;  // from split_policy
  float* part_stats;  // (B, H, R, splits, 4): base-2 max and sum over attended keys, then over generated keys
  float* part_acc;    // (B, H, R, splits, D_v): sum of 2^(score - split max) * v, null without V
  float* scores;      // (B, H, R, S) base-2 scores of the attended input keys (all head pooling reads), or null
  int64_t tile_keys = kTileKeys, key_groups = 1;  // from the policy; read by pipelined_split_kernel only
  // mma_split_kernel only, in place of `scores` (the log c update of 16-bit inputs: half the score bytes): each
  // attended input key's base-2 score as s - m in fp16, where m is the running max of the row in the warp that scores the
  // key's group of kRelativeScoreGroup keys (counted from key 0), taken after that group and stored in score_maxima
  // (B, H, R, ceil(S / 16)) float32. s <= m <= lse, so |s - m| <= |s - lse| = -log2 p: the fp16 value carries log p
  // to 2^-11 of itself. (B, H, R, relative_score_stride(S)), key j at relative_score_slot(j); the slots of a group's
  // other keys hold what the kernel computed for them, which nothing reads.
  __half* relative_scores = nullptr;
  float* score_maxima = nullptr;
};

// Where the keys of one item and head live: key * key_stride from `head` in a contiguous cache; through
// the item's row of the block table in a paged one.
template <typename T>
struct KeyRows {
  const T* head;  // the item's head, or the head in page 0 when paged
  int64_t key_stride, page_stride;
  const int32_t* table;  // the item's block-table row, or null
  FastDivisor page_size;
  int page_count;

  __device__ __forceinline__ const T* operator()(int64_t key) const {
    if (table == nullptr) return head + key * key_stride;
    // 32-bit: keys are in [0, 2^31) (the launcher checks the bound; the kernels clamp ranges at 0). The public op
    // validates the pages; clamping keeps a direct torch.ops call with a bad table in bounds.
    const uint32_t k = uint32_t(key), index = page_size.quotient(k);
    const int page = min(max(table[index], 0), page_count - 1);
    return head + int64_t(page) * page_stride + int64_t(k - index * page_size.divisor) * key_stride;
  }
};

// The keys (or, with V, the values) of item b and one KV head of a split kernel's cache.
template <typename T>
__device__ __forceinline__ KeyRows<T> cache_rows(const SplitParams<T>& p, bool values, int64_t b, int64_t kv_head) {
  const bool paged = p.block_table != nullptr;
  const int32_t* table = paged ? p.block_table + b * p.table_stride : nullptr;
  const T* base = values ? p.v : p.k;
  const int64_t item = values ? p.v_sb : p.k_sb, head = values ? p.v_sh : p.k_sh;
  return KeyRows<T>{base + (paged ? 0 : b * item) + kv_head * head, values ? p.v_ss : p.k_ss, item, table,
                    FastDivisor(paged ? uint32_t(p.page_size) : 1u), int(p.page_count)};
}

// A split's keys [begin, stop): those any of the block's rows attends (row i attends [starts[i], ends[i])), from the
// first (`first`) rounded down to a multiple of `align`, cut in whole tiles of `tile_keys` into `splits` shares.
struct SplitKeys {
  int64_t begin, stop, first;
};

__device__ __forceinline__ SplitKeys split_keys(const int64_t* starts, const int64_t* ends, int block_rows,
                                                int64_t keys, int64_t splits, int64_t split, int64_t tile_keys,
                                                int64_t align = 1) {
  int64_t first = keys, last = 0;
  for (int i = 0; i < block_rows; ++i) {
    if (starts[i] < ends[i]) {
      first = min(first, starts[i]);
      last = max(last, ends[i]);
    }
  }
  if (first > last) first = last;
  const int64_t aligned = first / align * align;
  const int64_t tiles_per_split = ceil_div(ceil_div(last - aligned, tile_keys), splits);
  const int64_t begin = aligned + split * tiles_per_split * tile_keys;
  return {begin, min(last, begin + tiles_per_split * tile_keys), first};
}

// Stages keys [tile, tile + kTileKeys) of one head as floats, rows at `pitch`; keys at or past `stop`
// become zeros (their weights are zero, and 0 * garbage could be NaN) and read no block-table entry.
template <typename T, int VEC>
__device__ __forceinline__ void stage_tile(const KeyRows<T>& rows, int64_t dim, int64_t tile, int64_t stop,
                                           float* tile_s, int64_t pitch) {
  // 32-bit index math: 64-bit division is emulated and would dominate this loop.
  const int chunks = int(dim / VEC);
  for (int c = threadIdx.x; c < kTileKeys * chunks; c += blockDim.x) {
    const int j = c / chunks, d0 = (c % chunks) * VEC;
    float values[VEC];
    if (tile + j < stop) {
      load_floats<T, VEC>(rows(tile + j) + d0, values);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) values[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) tile_s[j * pitch + d0 + i] = values[i];
  }
}

template <typename T, int VEC, bool WITH_V, bool SOFTCAP>
__global__ void __launch_bounds__(kMaxSplitThreads) split_kernel(SplitParams<T> p) {
  extern __shared__ __align__(16) unsigned char smem[];
  release_dependent_grid();  // the combine (common.cuh)
  const int64_t split = blockIdx.x, b = blockIdx.z;
  const int64_t row_chunks = ceil_div(p.rows, p.rows_per_block);
  const int64_t kv_head = blockIdx.y / row_chunks, row0 = (blockIdx.y % row_chunks) * p.rows_per_block;
  // Vector v of the block is query head head0 + v / block_rows at query row row0 + v % block_rows.
  const int block_rows = int(min(p.rows_per_block, p.rows - row0));
  const int group = int(p.heads / p.kv_heads), vectors = group * block_rows;
  const int dim = int(p.dim), dim_v = int(p.dim_v), pitch = int(key_pitch(p.dim));
  const int64_t head0 = kv_head * group;
  const auto row_of = [&](int v) {  // the flat (b, h, r) index of vector v
    return (b * p.heads + head0 + v / block_rows) * p.rows + row0 + v % block_rows;
  };

  int64_t* start_s = reinterpret_cast<int64_t*>(smem);  // [block_rows] each row's attended keys,
  int64_t* input_end_s = start_s + block_rows;          // [block_rows] its first generated key,
  int64_t* end_s = input_end_s + block_rows;            // [block_rows] and its end
  float* q_s = reinterpret_cast<float*>(end_s + block_rows);  // [vectors][dim]
  float* k_s = q_s + vectors * dim;                           // [kTileKeys][pitch]
  float* v_s = k_s + kTileKeys * pitch;                       // [kTileKeys][dim_v] when WITH_V
  float* p_s = v_s + (WITH_V ? kTileKeys * dim_v : 0);        // [vectors][kTileKeys]
  float* m_s = p_s + vectors * kTileKeys;                     // [vectors] running max, attended keys
  float* l_s = m_s + vectors;                                 // [vectors] running sum, attended keys
  float* mg_s = l_s + vectors;                                // [vectors] running max, generated keys
  float* lg_s = mg_s + vectors;                               // [vectors] running sum, generated keys
  float* factor_s = lg_s + vectors;                           // [vectors] rescaling of the output this tile

  for (int i = threadIdx.x; i < vectors * dim; i += blockDim.x) {
    const int v = i / dim;
    q_s[i] = to_float(p.q[b * p.q_sb + (head0 + v / block_rows) * p.q_sh + (row0 + v % block_rows) * p.q_sr +
                          i % dim]);
  }
  for (int rr = threadIdx.x; rr < block_rows; rr += blockDim.x) {
    const KeyRange range(p.start, p.input_end, p.end, b, row0 + rr, p.keys);
    start_s[rr] = range.start;
    input_end_s[rr] = range.input_end;
    end_s[rr] = range.end;
  }
  for (int v = threadIdx.x; v < vectors; v += blockDim.x) {
    m_s[v] = kNegInf;
    l_s[v] = 0.0f;
    mg_s[v] = kNegInf;
    lg_s[v] = 0.0f;
  }
  __syncthreads();

  const SplitKeys split_slice = split_keys(start_s, end_s, block_rows, p.keys, p.splits, split, kTileKeys);
  const int64_t begin = split_slice.begin, stop = split_slice.stop;
  const KeyRows<T> k_rows = cache_rows(p, false, b, kv_head);
  const KeyRows<T> v_rows = WITH_V ? cache_rows(p, true, b, kv_head) : KeyRows<T>{};
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;

  float acc[kMaxAccumulators];
#pragma unroll
  for (int a = 0; a < kMaxAccumulators; ++a) acc[a] = 0.0f;

  for (int64_t tile = begin; tile < stop; tile += kTileKeys) {
    __syncthreads();  // the previous tile's shared memory is no longer read
    stage_tile<T, VEC>(k_rows, dim, tile, stop, k_s, pitch);
    if (WITH_V) stage_tile<T, VEC>(v_rows, dim_v, tile, stop, v_s, dim_v);
    __syncthreads();

    // Scores of every vector against the tile's keys; a key outside a vector's row range scores -inf.
    for (int pair = threadIdx.x; pair < vectors * kTileKeys; pair += blockDim.x) {
      const int v = pair / kTileKeys, j = pair % kTileKeys, rr = v % block_rows;
      const int64_t key = tile + j;
      const bool attended = key < stop && key >= start_s[rr] && key < end_s[rr];
      float score = kNegInf;
      if (attended) {
        const float* q_row = q_s + v * dim;
        const float* k_row = k_s + j * pitch;
        float dot = 0.0f;
#pragma unroll 4
        for (int d = 0; d < dim; ++d) dot = fmaf(q_row[d], k_row[d], dot);
        score = SOFTCAP ? p.cap_out * tanhf(dot * p.cap_in) : dot * p.scale_log2;
        if (p.scores != nullptr && key < input_end_s[rr]) p.scores[row_of(v) * p.keys + key] = score;
      }
      p_s[pair] = score;
    }
    __syncthreads();

    // Online softmax per vector, one key per lane; p_s becomes 2^(score - running max).
    for (int v = warp; v < vectors; v += warps) {
      const float score = p_s[v * kTileKeys + lane];
      const float old_m = m_s[v], old_mg = mg_s[v];
      const float new_m = fmaxf(old_m, warp_max(score));
      const float weight = exp2_weight(score, new_m);
      const float factor = exp2_weight(old_m, new_m);
      const float tile_sum = warp_sum(weight);
      const float generated = tile + lane >= input_end_s[v % block_rows] ? score : kNegInf;
      const float new_mg = fmaxf(old_mg, warp_max(generated));
      const float generated_sum = warp_sum(exp2_weight(generated, new_mg));
      p_s[v * kTileKeys + lane] = weight;
      __syncwarp();  // the shuffles converge the lanes but do not order their reads of m_s and mg_s before these writes
      if (lane == 0) {
        m_s[v] = new_m;
        l_s[v] = l_s[v] * factor + tile_sum;
        lg_s[v] = lg_s[v] * exp2_weight(old_mg, new_mg) + generated_sum;
        mg_s[v] = new_mg;
        factor_s[v] = factor;
      }
    }

    if (WITH_V) {
      __syncthreads();
#pragma unroll
      for (int a = 0; a < kMaxAccumulators; ++a) {
        const int e = threadIdx.x + a * blockDim.x;
        if (e < vectors * dim_v) {
          const int v = e / dim_v, d = e % dim_v;
          const float* weights = p_s + v * kTileKeys;
          float sum = acc[a] * factor_s[v];
#pragma unroll 8
          for (int j = 0; j < kTileKeys; ++j) sum = fmaf(weights[j], v_s[j * dim_v + d], sum);
          acc[a] = sum;
        }
      }
    }
  }
  __syncthreads();

  for (int v = threadIdx.x; v < vectors; v += blockDim.x) {
    float* stats = p.part_stats + (row_of(v) * p.splits + split) * 4;
    stats[0] = m_s[v];
    stats[1] = l_s[v];
    stats[2] = mg_s[v];
    stats[3] = lg_s[v];
  }
  if (WITH_V) {
#pragma unroll
    for (int a = 0; a < kMaxAccumulators; ++a) {
      const int e = threadIdx.x + a * blockDim.x;
      if (e < vectors * dim_v) p.part_acc[(row_of(e / dim_v) * p.splits + split) * dim_v + e % dim_v] = acc[a];
    }
  }
}

template <typename T>
struct CombineParams {
  const float* part_stats;
  const float* part_acc;  // null without V
  int64_t rows_per_item, splits, dim_v;  // rows_per_item = H * R
  int64_t rows;                          // R
  const float* sinks;  // (H,) natural-log sink logits in each row's denominator, or null
  const float* lse_in;  // (B, H, R) natural log, contiguous, or null: normalise with the computed lse
  bool redistribute;
  float* stats;    // (B, H, R, 2) for head pooling: base-2 normaliser, generated mass; or null
  float* lse_out;  // (B, H, R) natural log, or null
  T* out;          // (B, H, R, D_v) contiguous, or null
};

// combine_kernel's dynamic shared memory: each split's weight in its row's output. The policies split the keys into
// at most one wave of blocks (16 a multiprocessor at the most, 2,112 on an H200): far under the 48 KB a launch
// may take without opting in.
__host__ __device__ inline size_t combine_smem_bytes(int64_t splits) { return size_t(splits) * sizeof(float); }

// Output columns a combine thread sums at once: 4 (one 16-byte load a split) where D_v is a multiple of 4, else 1.
__host__ __device__ inline int combine_columns(int64_t dim_v) { return dim_v % 4 == 0 ? 4 : 1; }

template <int W>
struct Columns {
  float v[W];
};

template <int W>
__device__ __forceinline__ Columns<W> load_columns(const float* source) {
  Columns<W> loaded;
  if constexpr (W == 4) {
    const float4 vector = *reinterpret_cast<const float4*>(source);
    loaded.v[0] = vector.x, loaded.v[1] = vector.y, loaded.v[2] = vector.z, loaded.v[3] = vector.w;
  } else {
    loaded.v[0] = *source;
  }
  return loaded;
}

// One block a query row. Each of its loads is an L2 round trip (another kernel wrote the partials), so the row's splits
// are read in as few as its threads allow, as Triton's combine reads them: the threads are groups of D_v / W lanes,
// each group summing every groups-th split's W columns a lane, kCombineChunk splits a load. Each thread issues its
// first chunk before it reads the splits' states (one 16-byte load a split, merged by shuffles and shared memory), so
// the two share a round trip: at one item on an H200 (33 splits at D 128: 4 groups of 32 lanes, 9 splits a thread) the
// whole row is read in one, its sink and a given lse with it. The groups' sums meet in shared memory, added in group
// order. The splits' weights wait in shared memory: a weight read from global memory next to its accumulator lets ptxas
// load the accumulator only after the weight's test, a second round trip per chunk. The launch bound asks for one block
// a multiprocessor, no more: without it ptxas held the 4-column kernel to 96 registers (5 blocks) and spilled 8 bytes
// of its chunk, and a pass of one short block a query row gains nothing from more resident blocks.
template <typename T, int W>
__global__ void __launch_bounds__(kCombineThreads, 1) combine_kernel(CombineParams<T> p) {
  static_assert(kCombineThreads % 32 == 0, "whole warps");
  constexpr int kWarps = kCombineThreads / 32;
  __shared__ float warp_states[kWarps][4];
  __shared__ float group_sums[kCombineThreads * W];
  extern __shared__ float split_weight[];  // [splits]: each split's max, then 2^(max - the row's max)
  // As the split kernel's programmatic dependent (split_kv, kernel.cu) it reads nothing before that kernel has ended;
  // its own dependent, the head pooling, may be placed at once.
  wait_for_prior_grid();
  release_dependent_grid();
  const int64_t row = blockIdx.y * p.rows_per_item + blockIdx.x;
  const float* part = p.part_stats + row * p.splits * 4;
  const int splits = int(p.splits);  // at most a wave of blocks
  // Column vectors of the row, and the lanes of a group: a D_v of more than kCombineThreads vectors takes one group
  // that steps over them.
  const int vectors = int(p.dim_v) / W, lanes = max(1, min(vectors, kCombineThreads));
  const int groups = kCombineThreads / lanes, group = threadIdx.x / lanes, lane = threadIdx.x % lanes;
  const bool summing = p.out != nullptr && vectors > 0 && group < groups;
  const float* acc = summing ? p.part_acc + row * p.splits * p.dim_v : nullptr;
  Columns<W> loaded[kCombineChunk];
  // The group's splits group + (first + i) * groups, i < kCombineChunk, columns [vector * W, vector * W + W); past the
  // last split the chunk reads the last one again and adds nothing: unconditional loads stay together.
  const auto load_chunk = [&](int first, int vector) {
#pragma unroll
    for (int i = 0; i < kCombineChunk; ++i) {
      const int split = min(group + (first + i) * groups, splits - 1);
      loaded[i] = load_columns<W>(acc + int64_t(split) * p.dim_v + vector * W);
    }
  };
  if (summing) load_chunk(0, lane);
  // The sink's logit and a given lse load beside the states too: used after the barrier, each read later would be a
  // round trip of its own.
  const float sink = p.sinks != nullptr ? p.sinks[blockIdx.x / p.rows] * kLog2e : 0.0f;
  const bool writes_stats = threadIdx.x == 0 && p.stats != nullptr;
  const float given_norm = writes_stats && p.lse_in != nullptr ? p.lse_in[row] * kLog2e : 0.0f;
  SoftmaxState all, generated;
  for (int s = threadIdx.x; s < splits; s += kCombineThreads) {
    const float4 stats = reinterpret_cast<const float4*>(part)[s];  // (max, sum, generated max, generated sum)
    all.merge(stats.x, stats.y);
    generated.merge(stats.z, stats.w);
    split_weight[s] = stats.x;
  }
  all.merge_warp();
  generated.merge_warp();
  const int warp_lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (warp_lane == 0) {
    warp_states[warp][0] = all.m;
    warp_states[warp][1] = all.l;
    warp_states[warp][2] = generated.m;
    warp_states[warp][3] = generated.l;
  }
  __syncthreads();
  all = generated = SoftmaxState{};
  for (int w = 0; w < kWarps; ++w) {  // every thread merges the warps' states in the same order
    all.merge(warp_states[w][0], warp_states[w][1]);
    generated.merge(warp_states[w][2], warp_states[w][3]);
  }
  if (p.sinks != nullptr) all.merge(sink, 1.0f);
  if (threadIdx.x == 0) {
    if (p.lse_out != nullptr) p.lse_out[row] = all.lse();
    if (writes_stats) {
      const float norm = p.lse_in == nullptr ? all.lse2() : given_norm;
      p.stats[2 * row] = norm;
      p.stats[2 * row + 1] = p.redistribute && generated.l > 0.0f ? generated.l * exp2_diff(generated.m, norm) : 0.0f;
    }
  }
  if (p.out == nullptr) return;
  // Each thread turns the maxima it stored into weights; a split whose rows attend no key (max -inf) weighs 0.
  for (int s = threadIdx.x; s < splits; s += kCombineThreads) split_weight[s] = exp2_weight(split_weight[s], all.m);
  __syncthreads();
  if (groups == 1 && group != 0) return;  // threads past the one group's lanes
  const float inverse = all.l > 0.0f ? 1.0f / all.l : 0.0f;
  for (int vector = lane; vector < vectors; vector += lanes) {  // once unless D_v has over kCombineThreads vectors
    float sum[W] = {};
    if (summing) {
      for (int first = 0;; first += kCombineChunk) {
        if (first > 0 || vector != lane) load_chunk(first, vector);
#pragma unroll
        for (int i = 0; i < kCombineChunk; ++i) {
          const int split = group + (first + i) * groups;
          const float weight = split < splits ? split_weight[split] : 0.0f;
          // A weight of 0 adds nothing, whatever the split's accumulator holds.
          if (weight != 0.0f) {
#pragma unroll
            for (int j = 0; j < W; ++j) sum[j] = fmaf(weight, loaded[i].v[j], sum[j]);
          }
        }
        if (group + (first + kCombineChunk) * groups >= splits) break;
      }
    }
    if (groups > 1) {  // one pass (vectors <= kCombineThreads / 2): the groups' sums meet
#pragma unroll
      for (int j = 0; j < W; ++j) group_sums[threadIdx.x * W + j] = sum[j];
      __syncthreads();
      if (group != 0) return;
      for (int g = 1; g < groups; ++g) {
#pragma unroll
        for (int j = 0; j < W; ++j) sum[j] += group_sums[(g * lanes + lane) * W + j];
      }
    }
#pragma unroll
    for (int j = 0; j < W; ++j) p.out[row * p.dim_v + vector * W + j] = from_float<T>(sum[j] * inverse);
  }
}

// Launches the split and combine passes on `stream` (defined and instantiated in kernel.cu). `kernel`: the split
// pass, for a policy from split_policy, pipelined_policy (split_kv_pipelined/kernel.cuh) or mma_policy
// (split_kv_mma/kernel.cuh, fp16 and bf16 only). `vectorized`: K (and V) rows start on 16-byte boundaries and D (and D_v) are multiples of 16 bytes.
template <typename T, bool WITH_V>
cudaError_t split_kv(const SplitParams<T>& p, const CombineParams<T>& combine, SplitKernel kernel, bool vectorized,
                     cudaStream_t stream);

}  // namespace macs

// The pipelined split kernel: the first pass of the split-KV pass (split_kv/kernel.cuh) rewritten to read K and V
// at memory bandwidth. It writes exactly what split_kernel writes (each split's base-2 max and sum over attended
// and over generated keys, the unnormalised partial output, the base-2 scores that head pooling reads), so the
// combine pass, head pooling and every launcher are shared with it, and so is the exactness of MACS: the pooled
// probabilities are recomputed from those scores and the final log-sum-exp, never from a split's own maximum.
//
// What changes against split_kernel (its tile is 32 keys converted to float in shared memory with plain loads, one
// tile in flight per block; the design follows FlashInfer's decode kernels, include/flashinfer/attention/decode.cuh):
// - K and V tiles stay in the input dtype and arrive by 16-byte cp.async (LDGSTS) in a kPipelineStages-deep ring:
//   while a block scores one tile, the next kPipelineStages - 1 are in flight.
// - A query vector (one query head at one query row) is held by `lanes` = D / (16 bytes) threads, each with 16
//   bytes' worth of q and of the output accumulator in registers; a dot product is a 16-byte shared-memory load,
//   VEC fused multiply-adds and log2(lanes) shuffles. The block's vectors (every query head of its KV head, times
//   its query rows) read each staged key once, and `key_groups` copies of them take disjoint keys of each tile,
//   merged in shared memory at the end as FlashInfer's sync_state does.
// - Each thread scores kKeysPerStep keys at once (independent shuffle chains) and rescales its output only when the
//   running maximum grows.
// - The scores of a tile go to shared memory and leave in coalesced rows after the next tile's barrier.
// It needs 16-byte aligned K/V rows, D / (16 bytes) a power of two <= 32, (H / H_kv) * D / (16 bytes) <= 256 and,
// with V, D_v == D (pipelined_fits); other shapes run split_kernel.
#pragma once

#include "split_kv/kernel.cuh"

namespace macs {

constexpr int kPipelineStages = 4;
constexpr int kPipelinedMaxThreads = 256;
// Two of the largest blocks per multiprocessor: caps the kernel at kPipelinedMaxRegisters a thread (65536 / (2 *
// 256)), four of the usual 128-thread blocks (tests/ops/test_cuda_build.py holds the compiler to it).
constexpr int kPipelinedMinBlocks = 2;
constexpr int64_t kPipelinedMaxRegisters = 65536 / (kPipelinedMaxThreads * kPipelinedMinBlocks);
constexpr int kKeysPerStep = 4;
constexpr int kMaxKeyGroups = 8;
// Bytes of K (and V) per stage that the tile size aims for. Four 8 KB stages keep 24 KB of reads in flight per block,
// about 100 KB per multiprocessor with the four 128-thread blocks that registers allow (a block takes about 34 KB of
// shared memory), against about 30 KB that 4.8 TB/s and a microsecond of latency need per multiprocessor.
constexpr int64_t kStageBytes = 8192;
constexpr int64_t kMinTileKeys = 16, kMaxTileKeys = 128;

__host__ __device__ inline int64_t floor_pow2(int64_t x) {
  int64_t p = 1;
  while (2 * p <= x) p *= 2;
  return p;
}

// Threads that hold one query vector: one per 16 bytes of the head dimension.
__host__ __device__ inline int64_t pipelined_lanes(int64_t dim, int64_t element_size) {
  return dim * element_size / 16;
}

__host__ inline bool pipelined_fits(int64_t group, int64_t dim, int64_t dim_v, bool with_v, bool vectorized,
                                    int64_t element_size) {
  const int64_t lanes = pipelined_lanes(dim, element_size);
  return vectorized && dim * element_size % 16 == 0 && lanes >= 1 && lanes <= 32 && floor_pow2(lanes) == lanes &&
         (!with_v || dim_v == dim) && group * lanes <= kPipelinedMaxThreads;
}

__host__ __device__ inline int64_t pipelined_tile_keys(int64_t dim, int64_t dim_v, bool with_v, int64_t element_size) {
  const int64_t row_bytes = (dim + (with_v ? dim_v : 0)) * element_size;
  const int64_t keys = floor_pow2(kStageBytes / row_bytes);
  return keys < kMinTileKeys ? kMinTileKeys : (keys > kMaxTileKeys ? kMaxTileKeys : keys);
}

__host__ __device__ inline int pipelined_threads(int64_t vectors, int64_t lanes, int64_t key_groups) {
  return int(ceil_div(vectors * lanes * key_groups, 32) * 32);
}

// Shared memory: the block rows' key ranges (int64), then the K (and V) stages, which the final merge of the key
// groups reuses, then two tiles of scores.
__host__ __device__ inline size_t pipelined_smem_bytes(int64_t vectors, int64_t block_rows, int64_t tile_keys,
                                                       int64_t key_groups, int64_t dim, int64_t dim_v, bool with_v,
                                                       int64_t element_size) {
  const int64_t stages = kPipelineStages * tile_keys * (dim + (with_v ? dim_v : 0)) * element_size;
  const int64_t merge = key_groups * vectors * ((with_v ? dim_v : 0) + 4) * int64_t(sizeof(float));
  const int64_t ranges = ceil_div(3 * block_rows * int64_t(sizeof(int64_t)), 16) * 16;
  return size_t(ranges + (stages > merge ? stages : merge) + 2 * vectors * tile_keys * int64_t(sizeof(float)));
}

__host__ inline SplitPolicy pipelined_policy(int64_t batch, int64_t heads, int64_t kv_heads, int64_t rows,
                                             int64_t keys, int64_t dim, int64_t dim_v, bool with_v,
                                             int64_t element_size, int64_t sm_count, int64_t smem_per_sm) {
  const int64_t group = heads / kv_heads, lanes = pipelined_lanes(dim, element_size);
  SplitPolicy policy;
  policy.kernel = SplitKernel::kPipelined;
  const int64_t fit = kPipelinedMaxThreads / (group * lanes);
  policy.rows_per_block = fit < rows ? fit : (rows < 1 ? 1 : rows);
  policy.row_chunks = ceil_div(rows < 1 ? 1 : rows, policy.rows_per_block);
  const int64_t vectors = group * policy.rows_per_block;
  policy.tile_keys = pipelined_tile_keys(dim, dim_v, with_v, element_size);
  // Enough key groups for about 128 threads, each group taking whole steps of kKeysPerStep keys of every tile.
  int64_t key_groups = floor_pow2(128 / (vectors * lanes) > 0 ? 128 / (vectors * lanes) : 1);
  const int64_t step_limit = policy.tile_keys / kKeysPerStep;
  key_groups = key_groups > kMaxKeyGroups ? kMaxKeyGroups : key_groups;
  policy.key_groups = key_groups > step_limit ? step_limit : key_groups;
  policy.threads = pipelined_threads(vectors, lanes, policy.key_groups);
  policy.smem_bytes = pipelined_smem_bytes(vectors, policy.rows_per_block, policy.tile_keys, policy.key_groups, dim,
                                           dim_v, with_v, element_size);
  // One wave of resident blocks (1 KB of shared memory per block is the runtime's), in whole tiles per split.
  const int64_t limits[3] = {smem_per_sm / int64_t(policy.smem_bytes + 1024), 2048 / policy.threads,
                             65536 / (policy.threads * kPipelinedMaxRegisters)};
  int64_t resident = limits[0];
  for (const int64_t limit : limits) resident = limit < resident ? limit : resident;
  if (resident < 1) resident = 1;
  // Rounded down: a few blocks past one wave would run as a second, nearly empty one.
  const int64_t wanted = resident * sm_count / (batch * kv_heads * policy.row_chunks);
  const int64_t tiles = ceil_div(keys, policy.tile_keys);
  policy.splits = wanted < tiles ? wanted : tiles;
  if (policy.splits < 1) policy.splits = 1;
  return policy;
}

// 16 bytes from global to shared memory without passing through registers (cp.async.cg: L2 only, the stream is
// read once); `fill` false writes zeros and reads nothing. Before sm_80, a plain 16-byte load and store.
__device__ __forceinline__ void copy16_async(void* shared, const void* global, bool fill) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(fill ? 16 : 0)
               : "memory");
#elif defined(MACS_CPU_EMULATION)
  cuda_emulation::copy16_async(shared, global, fill);
#else
  *reinterpret_cast<uint4*>(shared) = fill ? __ldg(reinterpret_cast<const uint4*>(global)) : make_uint4(0, 0, 0, 0);
#endif
}

__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#elif defined(MACS_CPU_EMULATION)
  cuda_emulation::copy_async_commit();
#endif
}

// Waits until at most PENDING of this thread's committed copy groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#elif defined(MACS_CPU_EMULATION)
  cuda_emulation::copy_async_wait(PENDING);
#endif
}

template <typename T, bool WITH_V>
__global__ void __launch_bounds__(kPipelinedMaxThreads, kPipelinedMinBlocks) pipelined_split_kernel(SplitParams<T> p) {
  constexpr int VEC = kVec16<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  release_dependent_grid();  // the combine (common.cuh)
  const int64_t split = blockIdx.x, b = blockIdx.z;
  const int64_t row_chunks = ceil_div(p.rows, p.rows_per_block);
  const int64_t kv_head = blockIdx.y / row_chunks, row0 = (blockIdx.y % row_chunks) * p.rows_per_block;
  const int block_rows = int(min(p.rows_per_block, p.rows - row0));
  const int group = int(p.heads / p.kv_heads), vectors = group * block_rows;
  const int dim = int(p.dim), tile_keys = int(p.tile_keys), key_groups = int(p.key_groups);
  const int lanes = dim / VEC, lane_shift = __ffs(lanes) - 1, tile_shift = __ffs(tile_keys) - 1;
  const int64_t head0 = kv_head * group;
  // The softcap is a uniform branch here (split_kernel makes it a template flag): half the instantiations.
  const bool capped = p.cap_out != 0.0f;

  // Thread roles: 16-byte slice `part` of vector `vector`, taking the keys of key group `key_group` in each tile.
  // Threads past vectors * key_groups (the block is whole warps) compute alongside vector 0 and keep nothing.
  const int part = threadIdx.x & (lanes - 1), slot = threadIdx.x >> lane_shift;
  const bool keeps = slot < vectors * key_groups;
  const int vector = keeps ? slot % vectors : 0, key_group = keeps ? slot / vectors : 0;
  const int rr = vector % block_rows;
  const int64_t row = (b * p.heads + head0 + vector / block_rows) * p.rows + row0 + rr;  // flat (b, h, r)

  int64_t* range_s = reinterpret_cast<int64_t*>(smem);  // [3][block_rows]: start, input_end, end
  unsigned char* stages = smem + ceil_div(3 * block_rows * int64_t(sizeof(int64_t)), 16) * 16;
  T* k_stages = reinterpret_cast<T*>(stages);                      // [kPipelineStages][tile_keys][dim]
  T* v_stages = k_stages + kPipelineStages * tile_keys * dim;      // the same for V
  const int64_t stage_bytes =
      int64_t(kPipelineStages) * tile_keys * (dim + (WITH_V ? dim : 0)) * int64_t(sizeof(T));
  const int64_t merge_bytes = int64_t(key_groups) * vectors * ((WITH_V ? dim : 0) + 4) * int64_t(sizeof(float));
  float* score_s = reinterpret_cast<float*>(stages + max(stage_bytes, merge_bytes));  // [2][vectors][tile_keys]

  for (int i = threadIdx.x; i < block_rows; i += blockDim.x) {
    const KeyRange range(p.start, p.input_end, p.end, b, row0 + i, p.keys);
    range_s[i] = range.start;
    range_s[block_rows + i] = range.input_end;
    range_s[2 * block_rows + i] = range.end;
  }
  float q[VEC];
  {
    const T* q_row = p.q + b * p.q_sb + (head0 + vector / block_rows) * p.q_sh + (row0 + rr) * p.q_sr + part * VEC;
#pragma unroll
    for (int i = 0; i < VEC; ++i) q[i] = to_float(q_row[i]);  // q may be any view: element loads, once
  }
  __syncthreads();
  const int64_t start = range_s[rr], input_end = range_s[block_rows + rr], end = range_s[2 * block_rows + rr];

  const SplitKeys split_slice = split_keys(range_s, range_s + 2 * block_rows, block_rows, p.keys, p.splits, split,
                                           tile_keys);
  const int64_t begin = split_slice.begin, stop = split_slice.stop;
  const int tiles = begin < stop ? int(ceil_div(stop - begin, tile_keys)) : 0;
  const KeyRows<T> k_rows = cache_rows(p, false, b, kv_head);
  const KeyRows<T> v_rows = WITH_V ? cache_rows(p, true, b, kv_head) : KeyRows<T>{};

  // Thread c copies 16 bytes at column (c % lanes) * VEC of tile keys c / lanes + copy_step i, each a pointer step
  // from the last where the cache is contiguous (a key lookup a copy took about four times the instructions). Keys
  // at or past `stop` are zero-filled (0 * garbage could be NaN): their copies name the head's (or page 0's) first
  // row, which exists, and read no byte of it.
  const int copy_step = int(blockDim.x) >> lane_shift, copy_key = int(threadIdx.x) >> lane_shift;
  const int copy_d = part * VEC, stop_offset = tiles > 0 ? int(stop - begin) : 0;
  const T* k_outside = k_rows.head + copy_d;
  const T* v_outside = WITH_V ? v_rows.head + copy_d : nullptr;
  const int64_t k_step = copy_step * k_rows.key_stride, v_step = copy_step * v_rows.key_stride;
  const auto load_tile = [&](int t) {
    const int key0 = t * tile_keys;  // the tile's first key, from begin
    const int stage = (t % kPipelineStages) * tile_keys * dim + copy_key * dim + copy_d;
    T* k_dst = k_stages + stage;
    T* v_dst = v_stages + stage;
    if (WITH_V || k_rows.table == nullptr) {  // the launcher takes a paged cache without V only
      const T* k_src = k_rows.head + (begin + key0 + copy_key) * k_rows.key_stride + copy_d;
      const T* v_src = WITH_V ? v_rows.head + (begin + key0 + copy_key) * v_rows.key_stride + copy_d : nullptr;
      for (int j = copy_key; j < tile_keys; j += copy_step) {
        const bool inside = key0 + j < stop_offset;
        copy16_async(k_dst, inside ? k_src : k_outside, inside);
        k_dst += copy_step * dim;
        k_src += k_step;
        if constexpr (WITH_V) {
          copy16_async(v_dst, inside ? v_src : v_outside, inside);
          v_dst += copy_step * dim;
          v_src += v_step;
        }
      }
    } else {
      for (int j = copy_key; j < tile_keys; j += copy_step, k_dst += copy_step * dim) {
        const bool inside = key0 + j < stop_offset;
        copy16_async(k_dst, inside ? k_rows(begin + key0 + j) + copy_d : k_outside, inside);
      }
    }
  };
  // Scores of tile t (buffer t % 2) to their rows, for the attended input keys (the pooling reads no others),
  // consecutive threads on consecutive keys.
  const FastDivisor by_block_rows(block_rows);
  const auto store_scores = [&](int t) {
    const int64_t tile0 = begin + int64_t(t) * tile_keys;
    const float* tile_scores = score_s + (t & 1) * vectors * tile_keys;
    for (int e = threadIdx.x; e < vectors * tile_keys; e += blockDim.x) {
      const int v = e >> tile_shift, j = e & (tile_keys - 1), head = int(by_block_rows.quotient(v));
      const int r = v - head * block_rows;
      const int64_t key = tile0 + j;
      if (key < stop && key >= range_s[r] && key < range_s[block_rows + r]) {
        p.scores[((b * p.heads + head0 + head) * p.rows + row0 + r) * p.keys + key] = tile_scores[e];
      }
    }
  };

#pragma unroll
  for (int t = 0; t < kPipelineStages - 1; ++t) {
    if (t < tiles) load_tile(t);
    copy_async_commit();  // empty groups too: group t is always tile t
  }

  float m = kNegInf, l = 0.0f, mg = kNegInf, lg = 0.0f;  // running max and sum, attended and generated keys
  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
  const int keys_per_group = tile_keys / key_groups;

  for (int t = 0; t < tiles; ++t) {
    copy_async_wait<kPipelineStages - 2>();  // this thread's copies of tile t have landed
    __syncthreads();  // everyone's have, and nobody still reads tile t - 1's stage or scores buffer t % 2
    if (t + kPipelineStages - 1 < tiles) load_tile(t + kPipelineStages - 1);  // into tile t - 1's stage
    copy_async_commit();
    if (p.scores != nullptr && t > 0) store_scores(t - 1);

    const int64_t tile0 = begin + int64_t(t) * tile_keys;
    // The vector's attended keys [attend_lo, attend_hi) and first generated key of this tile, as offsets j from
    // tile0 clamped into [0, tile_keys]: the loop compares 32-bit offsets, not 64-bit keys.
    const auto offset = [&](int64_t key) { return int(min(max(key - tile0, int64_t(0)), int64_t(tile_keys))); };
    const int attend_lo = offset(start), attend_hi = offset(min(end, stop)), generated_lo = offset(input_end);
    const T* k_tile = k_stages + (t % kPipelineStages) * tile_keys * dim + part * VEC;
    const T* v_tile = v_stages + (t % kPipelineStages) * tile_keys * dim + part * VEC;
    float* tile_scores = score_s + (t & 1) * vectors * tile_keys + vector * tile_keys;
    for (int j0 = key_group * keys_per_group; j0 < (key_group + 1) * keys_per_group; j0 += kKeysPerStep) {
      float s[kKeysPerStep];
#pragma unroll
      for (int k = 0; k < kKeysPerStep; ++k) {
        const uint4 raw = *reinterpret_cast<const uint4*>(k_tile + (j0 + k) * dim);
        const T* key = reinterpret_cast<const T*>(&raw);
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) dot = fmaf(q[i], to_float(key[i]), dot);
        s[k] = dot;
      }
      // Butterfly sums within the vector's lanes: every lane ends with the same bits (addition commutes).
      for (int offset = lanes / 2; offset > 0; offset >>= 1) {
#pragma unroll
        for (int k = 0; k < kKeysPerStep; ++k) s[k] += __shfl_xor_sync(0xffffffffu, s[k], offset);
      }
      float step_max = kNegInf, generated_max = kNegInf;
#pragma unroll
      for (int k = 0; k < kKeysPerStep; ++k) {
        const int j = j0 + k;
        const bool attended = j >= attend_lo && j < attend_hi;
        s[k] = attended ? (capped ? p.cap_out * tanhf(s[k] * p.cap_in) : s[k] * p.scale_log2) : kNegInf;
        step_max = fmaxf(step_max, s[k]);
        if (j >= generated_lo) generated_max = fmaxf(generated_max, s[k]);
        if (part == 0 && keeps) tile_scores[j0 + k] = s[k];
      }
      if (step_max > m) {
        const float factor = exp2_weight(m, step_max);
        l *= factor;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] *= factor;
        m = step_max;
      }
      if (generated_max > mg) {
        lg *= exp2_weight(mg, generated_max);
        mg = generated_max;
      }
#pragma unroll
      for (int k = 0; k < kKeysPerStep; ++k) {
        const float weight = exp2_weight(s[k], m);
        l += weight;
        if (j0 + k >= generated_lo) lg += exp2_weight(s[k], mg);
        if (WITH_V) {
          const uint4 raw = *reinterpret_cast<const uint4*>(v_tile + (j0 + k) * dim);
          const T* value = reinterpret_cast<const T*>(&raw);
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[i] = fmaf(weight, to_float(value[i]), acc[i]);
        }
      }
    }
  }
  copy_async_wait<0>();  // only empty groups remain, but the stages are reused below
  __syncthreads();
  if (p.scores != nullptr && tiles > 0) store_scores(tiles - 1);

  // Merge the key groups' states (each relative to its own max) per vector, as the combine pass merges splits.
  float* merge_stats = reinterpret_cast<float*>(stages);       // [key_groups][vectors][4]
  float* merge_acc = merge_stats + key_groups * vectors * 4;   // [key_groups][vectors][dim] with V
  if (keeps) {
    const int at = key_group * vectors + vector;
    if (part == 0) {
      merge_stats[4 * at] = m;
      merge_stats[4 * at + 1] = l;
      merge_stats[4 * at + 2] = mg;
      merge_stats[4 * at + 3] = lg;
    }
    if (WITH_V) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) merge_acc[at * dim + part * VEC + i] = acc[i];
    }
  }
  __syncthreads();
  if (!keeps || key_group != 0) return;
  SoftmaxState all, generated;
  for (int z = 0; z < key_groups; ++z) {
    const float* stats = merge_stats + 4 * (z * vectors + vector);
    all.merge(stats[0], stats[1]);
    generated.merge(stats[2], stats[3]);
  }
  if (part == 0) {
    float* stats = p.part_stats + (row * p.splits + split) * 4;
    stats[0] = all.m;
    stats[1] = all.l;
    stats[2] = generated.m;
    stats[3] = generated.l;
  }
  if (WITH_V) {
    float total[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) total[i] = 0.0f;
    for (int z = 0; z < key_groups; ++z) {
      const float weight = exp2_weight(merge_stats[4 * (z * vectors + vector)], all.m);
#pragma unroll
      for (int i = 0; i < VEC; ++i) total[i] = fmaf(weight, merge_acc[(z * vectors + vector) * dim + part * VEC + i],
                                                    total[i]);
    }
    float* out = p.part_acc + (row * p.splits + split) * dim + part * VEC;
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      *reinterpret_cast<float4*>(out + i) = make_float4(total[i], total[i + 1], total[i + 2], total[i + 3]);
    }
  }
}

// Launches pipelined_split_kernel on `stream` for a policy from pipelined_policy (defined and instantiated in
// kernel.cu); the combine pass follows in split_kv.
template <typename T, bool WITH_V>
cudaError_t pipelined_split(const SplitParams<T>& p, cudaStream_t stream);

}  // namespace macs

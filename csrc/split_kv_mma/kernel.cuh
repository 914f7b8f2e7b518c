// The tensor-core split kernel: the first pass of the split-KV pass (split_kv/kernel.cuh) with QK^T and PV on
// tensor cores (mma.sync.m16n8k16, fp16/bf16 in, fp32 accumulate), as FlashInfer's grouped decode with
// use_tensor_cores and sdpa's flash decoding do. It writes what split_kernel writes (each split's base-2 max and sum
// over attended and over generated keys, the unnormalised partial output, the base-2 scores that head pooling reads:
// fp32, or for the log c update fp16 relative to group maxima, SplitParams::relative_scores), so the combine pass,
// head pooling and MACS's row (softmax of the last query, the spread of generated-token mass, max over heads, floor)
// are shared with the other split kernels and computed from the same fp32 scores: only the attention output sees P
// rounded to the input dtype before PV, as in FlashAttention.
//
// Why: at GQA 4:1 and D 128 a decode step does 1,024 multiply-adds per key and KV head for 512 bytes of K and V;
// on CUDA cores (pipelined_split_kernel) that caps the pass at 1.0-1.5 TB/s on an H200 (issue 48).
//
// Layout (csrc/emulation/cpu.h runs it on the CPU, its MMAs and ldmatrix as the PTX ISA defines them):
// - A block owns one KV head, up to 16 query vectors (every query head of the KV head times a chunk of query
//   rows, vector m = head m / block_rows at row m % block_rows, as pipelined_split_kernel orders them) on the M
//   side of the MMA, padded to 16 with vectors that attend no key, and one slice of the keys.
// - K and V tiles of kMmaTileKeys keys stay in the input dtype and arrive by 16-byte cp.async (LDGSTS) in a
//   kMmaStages-deep ring, rows padded by 16 bytes so that fragment loads hit 32 different banks.
// - Warp w takes keys [16 w, 16 w + 16) of each tile: S = Q K^T is two m16n8 tiles over D / 16 k-steps (K's rows
//   are the col-major B operand as stored); its fp32 accumulators become, rounded, the A operand of P V (the
//   m16n8k16 C layout of two n8 tiles is the A layout of one k16 step), and V's B fragments come by ldmatrix.trans.
// - Each warp keeps its own online softmax per vector (rows g and g + 8 of its fragments; the four lanes of a row
//   agree on its max by two shuffles) and the warps' states are merged in shared memory at the end, as
//   pipelined_split_kernel merges its key groups.
// It needs fp16/bf16, 16-byte aligned K/V rows, D in {64, 128}, D_v == D with V and (H / H_kv) <= 16 (mma_fits);
// other shapes run pipelined_split_kernel or split_kernel.
#pragma once

#include "split_kv_pipelined/kernel.cuh"

namespace macs {

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = 32 * kMmaWarps;
constexpr int kMmaRows = 16;                   // the MMA's M: query vectors per block
constexpr int kMmaTileKeys = 16 * kMmaWarps;   // a k16 step of PV per warp
constexpr int kMmaStages = 3;
constexpr int kMmaPad = 8;                     // elements (16 bytes) of padding per staged row

// Blocks per multiprocessor that an instantiation's registers allow. __launch_bounds__ caps ptxas at
// 65536 / (kMmaThreads * blocks) registers a thread, and tests/ops/test_cuda_build.py checks, for sm_80 and sm_90,
// that ptxas spills nothing under the cap and needs more registers than one more block would leave: the policy's
// wave is then the one the GPU runs, with no tail wave of blocks that cannot be resident. With V, Q's fragments and
// the output's hold 96 registers at D 128 (2 blocks: 184-188 registers) and 48 at D 64 (4 blocks: 126-128); without V
// 114-115 at D 128 (4 blocks) and 96 at D 64 (5 blocks).
__host__ __device__ constexpr int mma_blocks_by_registers(int64_t dim, bool with_v) {
  return with_v ? (dim == 64 ? 4 : 2) : (dim == 64 ? 5 : 4);
}

__host__ inline bool mma_fits(int64_t group, int64_t dim, int64_t dim_v, bool with_v, bool vectorized,
                              int64_t element_size) {
  return vectorized && element_size == 2 && (dim == 64 || dim == 128) && (!with_v || dim_v == dim) && group >= 1 &&
         group <= kMmaRows;
}

// Shared memory: the block rows' key ranges (int64), then the K (and V) stages, which the final merge of the warps'
// states reuses.
__host__ __device__ inline size_t mma_smem_bytes(int64_t block_rows, int64_t dim, bool with_v) {
  const int64_t ranges = ceil_div(3 * block_rows * int64_t(sizeof(int64_t)), 16) * 16;
  const int64_t stages = int64_t(kMmaStages) * kMmaTileKeys * (dim + kMmaPad) * (with_v ? 2 : 1) * 2;
  const int64_t merge = int64_t(kMmaWarps) * kMmaRows * ((with_v ? dim : 0) + 4) * int64_t(sizeof(float));
  return size_t(ranges + (stages > merge ? stages : merge));
}

__host__ inline SplitPolicy mma_policy(int64_t batch, int64_t heads, int64_t kv_heads, int64_t rows, int64_t keys,
                                       int64_t dim, bool with_v, int64_t sm_count, int64_t smem_per_sm) {
  const int64_t group = heads / kv_heads, fit = kMmaRows / group;
  SplitPolicy policy;
  policy.kernel = SplitKernel::kMma;
  policy.rows_per_block = fit < rows ? fit : (rows < 1 ? 1 : rows);
  policy.row_chunks = ceil_div(rows < 1 ? 1 : rows, policy.rows_per_block);
  policy.tile_keys = kMmaTileKeys;
  policy.threads = kMmaThreads;
  policy.smem_bytes = mma_smem_bytes(policy.rows_per_block, dim, with_v);
  // One wave of resident blocks (1 KB of shared memory per block is the runtime's), in whole tiles per split (as
  // pipelined_policy).
  const int64_t limits[3] = {smem_per_sm / int64_t(policy.smem_bytes + 1024), 2048 / kMmaThreads,
                             mma_blocks_by_registers(dim, with_v)};
  int64_t resident = limits[0];
  for (const int64_t limit : limits) resident = limit < resident ? limit : resident;
  if (resident < 1) resident = 1;
  const int64_t wanted = resident * sm_count / (batch * kv_heads * policy.row_chunks);
  const int64_t tiles = ceil_div(keys, kMmaTileKeys);
  policy.splits = wanted < tiles ? wanted : tiles;
  if (policy.splits < 1) policy.splits = 1;
  return policy;
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// c += a b for one m16n8k16 tile (PTX ISA, "Matrix Fragments for mma.m16n8k16"): with g = lane / 4, t = lane % 4,
// a = {A[g][2t..], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..]}, b = {B[2t..][g], B[2t+8..][g]} (pairs along k),
// c = {C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]}.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // m16n8k16 needs sm_80; the launcher never picks this kernel below it (launch_utils.h)
#elif defined(MACS_CPU_EMULATION)
  cuda_emulation::mma_m16n8k16<T>(c, a, b0, b1);
#endif
}

// Four 8x8 16-bit matrices from shared memory: lane i names row i % 8 of matrix i / 8; register j gets the element
// pair (row g; columns 2t, 2t + 1) of matrix j, or TRANSPOSED (rows 2t, 2t + 1; column g) (PTX ISA, ldmatrix).
template <bool TRANSPOSED>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (TRANSPOSED) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // as mma16816
#elif defined(MACS_CPU_EMULATION)
  cuda_emulation::ldmatrix_x4(r, row, TRANSPOSED);
#endif
}

// The max of x over the four lanes that hold a row of an m16n8 C fragment (t = 0..3, the same g).
__device__ __forceinline__ float row_max(float x) {
#pragma unroll
  for (int offset = 1; offset < 4; offset <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

template <typename T, int DIM, bool WITH_V>
__global__ void __launch_bounds__(kMmaThreads, mma_blocks_by_registers(DIM, WITH_V))
    mma_split_kernel(SplitParams<T> p) {
  constexpr int PITCH = DIM + kMmaPad, KSTEPS = DIM / 16, NTILES = DIM / 8, VEC = kVec16<T>, LANES = DIM / VEC;
  extern __shared__ __align__(16) unsigned char smem[];
  release_dependent_grid();  // the combine (common.cuh)
  const int64_t split = blockIdx.x, b = blockIdx.z;
  const int64_t row_chunks = ceil_div(p.rows, p.rows_per_block);
  const int64_t kv_head = blockIdx.y / row_chunks, row0 = (blockIdx.y % row_chunks) * p.rows_per_block;
  const int block_rows = int(min(p.rows_per_block, p.rows - row0));
  const int group = int(p.heads / p.kv_heads), vectors = group * block_rows;
  const int64_t head0 = kv_head * group;
  const bool capped = p.cap_out != 0.0f;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;

  int64_t* range_s = reinterpret_cast<int64_t*>(smem);  // [3][block_rows]: start, input_end, end
  unsigned char* stages = smem + ceil_div(3 * block_rows * int64_t(sizeof(int64_t)), 16) * 16;
  T* k_stages = reinterpret_cast<T*>(stages);              // [kMmaStages][kMmaTileKeys][PITCH]
  T* v_stages = k_stages + kMmaStages * kMmaTileKeys * PITCH;  // the same for V

  for (int i = threadIdx.x; i < block_rows; i += blockDim.x) {
    const KeyRange range(p.start, p.input_end, p.end, b, row0 + i, p.keys);
    range_s[i] = range.start;
    range_s[block_rows + i] = range.input_end;
    range_s[2 * block_rows + i] = range.end;
  }
  // Q's A fragments, once: rows g and g + 8 (vectors past `vectors` are zeros), columns 2t.. and 2t + 8.. of each
  // k-step. q may be any view: element loads.
  uint32_t qa[KSTEPS][4];
  {
    const T* q_rows[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = g + 8 * h;
      q_rows[h] = m < vectors ? p.q + b * p.q_sb + (head0 + m / block_rows) * p.q_sh + (row0 + m % block_rows) * p.q_sr
                              : nullptr;
    }
    const auto pair = [&](int h, int d) {
      return q_rows[h] == nullptr ? 0u : pack2<T>(to_float(q_rows[h][d]), to_float(q_rows[h][d + 1]));
    };
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      qa[ks][0] = pair(0, 16 * ks + 2 * t);
      qa[ks][1] = pair(1, 16 * ks + 2 * t);
      qa[ks][2] = pair(0, 16 * ks + 2 * t + 8);
      qa[ks][3] = pair(1, 16 * ks + 2 * t + 8);
    }
  }
  __syncthreads();
  // With relative scores, splits start at a multiple of kRelativeScoreGroup keys, so that each warp's 16 keys are one
  // group of their maxima; keys before the block's first attended key are zero-filled, not read.
  static_assert(kMmaTileKeys / kMmaWarps == kRelativeScoreGroup, "a warp's keys are one relative-score group");
  const SplitKeys split_slice = split_keys(range_s, range_s + 2 * block_rows, block_rows, p.keys, p.splits, split,
                                           kMmaTileKeys, p.relative_scores != nullptr ? kRelativeScoreGroup : 1);
  const int64_t begin = split_slice.begin, stop = split_slice.stop, first = split_slice.first;
  const int tiles = begin < stop ? int(ceil_div(stop - begin, kMmaTileKeys)) : 0;
  // This thread's two vectors' attended keys [lo, hi) and first generated key (its input keys: [lo, generated_lo)),
  // as offsets from `begin` clamped into [0, stop - begin]: the key loop compares 32-bit offsets, not 64-bit keys
  // (64-bit compares take two instructions and twice the registers). A padding vector attends nothing.
  const auto offset = [&](int64_t key) { return int(min(max(key - begin, int64_t(0)), max(stop - begin, int64_t(0)))); };
  int lo[2], generated_lo[2], hi[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = g + 8 * h, rr = m % block_rows;
    const bool real = m < vectors;
    lo[h] = real ? offset(range_s[rr]) : 0;
    generated_lo[h] = real ? offset(range_s[block_rows + rr]) : 0;
    hi[h] = real ? offset(range_s[2 * block_rows + rr]) : 0;
  }
  // The flat (b, h, r) row of each vector, once: the key loop indexes the scores by it, and computing it there cost
  // a division by block_rows per stored score.
  int64_t score_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int vector = g + 8 * h;
    score_row[h] = (b * p.heads + head0 + vector / block_rows) * p.rows + row0 + vector % block_rows;
  }
  const KeyRows<T> k_rows = cache_rows(p, false, b, kv_head);
  const KeyRows<T> v_rows = WITH_V ? cache_rows(p, true, b, kv_head) : KeyRows<T>{};

  // Thread c copies 16 bytes at column (c % LANES) * VEC of keys c / LANES + COPY_STEP i of each tile: COPIES copies
  // of K (and V) in straight-line code, each a pointer step from the last where the cache is contiguous (a copy loop
  // over c with a key lookup each took about 410 of a warp's 945 instructions a tile at D 128 with V on sm_90).
  constexpr int COPY_STEP = kMmaThreads / LANES, COPIES = kMmaTileKeys / COPY_STEP;
  static_assert(kMmaThreads % LANES == 0 && kMmaTileKeys % COPY_STEP == 0, "whole rows per pass of the block");
  const int copy_key = threadIdx.x / LANES, copy_d = (threadIdx.x % LANES) * VEC;
  const int first_offset = int(first - begin), stop_offset = int(stop - begin);
  // Keys outside [first, stop) are zero-filled (0 * garbage could be NaN): their copies name the head's (or page 0's)
  // first row, which exists, and read nothing. (A key lookup here would read the block table past its row for a split
  // without tiles.)
  const T* k_outside = k_rows.head + copy_d;
  const T* v_outside = WITH_V ? v_rows.head + copy_d : nullptr;
  const int64_t k_step = COPY_STEP * k_rows.key_stride, v_step = COPY_STEP * v_rows.key_stride;
  const auto load_tile = [&](int tile) {
    const int key0 = tile * kMmaTileKeys + copy_key;  // this thread's first key of the tile, from begin
    const int stage = (tile % kMmaStages) * kMmaTileKeys * PITCH + copy_key * PITCH + copy_d;
    const auto copy_keys = [&](const auto& k_source, const auto& v_source) {
#pragma unroll
      for (int i = 0; i < COPIES; ++i) {
        const int j = key0 + i * COPY_STEP;
        const bool inside = j < stop_offset && j >= first_offset;
        copy16_async(k_stages + stage + i * COPY_STEP * PITCH, inside ? k_source(i, j) : k_outside, inside);
        if constexpr (WITH_V) {
          copy16_async(v_stages + stage + i * COPY_STEP * PITCH, inside ? v_source(i, j) : v_outside, inside);
        }
      }
    };
    if (WITH_V || k_rows.table == nullptr) {  // the launcher takes a paged cache without V only
      const T* k_first = k_rows.head + (begin + key0) * k_rows.key_stride + copy_d;
      const T* v_first = WITH_V ? v_rows.head + (begin + key0) * v_rows.key_stride + copy_d : nullptr;
      copy_keys([&](int i, int) { return k_first + i * k_step; }, [&](int i, int) { return v_first + i * v_step; });
    } else {
      copy_keys([&](int, int j) { return k_rows(begin + j) + copy_d; },
                [&](int, int j) { return v_rows(begin + j) + copy_d; });
    }
  };

#pragma unroll
  for (int tile = 0; tile < kMmaStages - 1; ++tile) {
    if (tile < tiles) load_tile(tile);
    copy_async_commit();  // empty groups too: group `tile` is always that tile
  }

  // Per vector h (rows g, g + 8): running max and this lane's share of the sum, attended and generated keys.
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f}, mg[2] = {kNegInf, kNegInf}, lg[2] = {0.0f, 0.0f};
  float acc[NTILES][4];  // the output's C fragments: acc[n][2h + i] = O[g + 8h][8n + 2t + i]
#pragma unroll
  for (int n = 0; n < NTILES; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;
  }

  for (int tile = 0; tile < tiles; ++tile) {
    copy_async_wait<kMmaStages - 2>();  // this thread's copies of this tile have landed
    __syncthreads();  // everyone's have, and nobody still reads the stage the next load overwrites
    if (tile + kMmaStages - 1 < tiles) load_tile(tile + kMmaStages - 1);
    copy_async_commit();

    const int j0 = tile * kMmaTileKeys + 16 * warp;  // this warp's first key, as an offset from begin
    const T* k_tile = k_stages + (tile % kMmaStages) * kMmaTileKeys * PITCH + 16 * warp * PITCH;
    const T* v_tile = v_stages + (tile % kMmaStages) * kMmaTileKeys * PITCH + 16 * warp * PITCH;

    // S = Q K^T over this warp's 16 keys: s[nt][2h + i] = S[g + 8h][8 nt + 2t + i]. B[k][n] = K[n][k]: key n's row
    // as stored, so one ldmatrix gives a k-step's B fragments of both n8 tiles: its matrices are keys 8 nt + (0..7)
    // at columns 16 ks + 8 half, for (nt, half) = (0, 0), (0, 1), (1, 0), (1, 1).
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = 0.0f;
    }
    const T* k_lane = k_tile + (8 * (lane >> 4) + (lane & 7)) * PITCH + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      uint32_t kb[4];
      ldmatrix_x4<false>(kb, k_lane + 16 * ks);
      mma16816<T>(s[0], qa[ks], kb[0], kb[1]);
      mma16816<T>(s[1], qa[ks], kb[2], kb[3]);
    }

    // Scale (the softcap's branch taken alike by the whole block), mask, write the scores head pooling reads, and
    // step the online softmax of vectors g and g + 8.
    if (capped) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[nt][i] = p.cap_out * tanhf(s[nt][i] * p.cap_in);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[nt][i] *= p.scale_log2;
      }
    }
    float step_max[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int h = i >> 1, j = j0 + 8 * nt + 2 * t + (i & 1);
        if (j < lo[h] || j >= hi[h]) s[nt][i] = kNegInf;
        step_max[h] = fmaxf(step_max[h], s[nt][i]);
      }
    }
    if (p.scores != nullptr) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = i >> 1, j = j0 + 8 * nt + 2 * t + (i & 1);
          if (j >= lo[h] && j < generated_lo[h]) p.scores[score_row[h] * p.keys + begin + j] = s[nt][i];  // input
        }
      }
    }
    float factor[2];
    bool max_rose = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float new_m = fmaxf(m[h], row_max(step_max[h]));
      factor[h] = exp2_weight(m[h], new_m);
      max_rose |= new_m != m[h];
      l[h] *= factor[h];
      m[h] = new_m;
    }
    // The generated keys' softmax steps only where one of the warp's rows attends a generated key among its 16 (a
    // decode step's last tiles): elsewhere each step would add 0 and scale by 1.
    const bool generated_here = (j0 + 16 > generated_lo[0] && j0 < hi[0]) || (j0 + 16 > generated_lo[1] && j0 < hi[1]);
    if (__any_sync(0xffffffffu, generated_here)) {
      float generated_max[2] = {kNegInf, kNegInf};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = i >> 1, j = j0 + 8 * nt + 2 * t + (i & 1);
          if (j >= generated_lo[h]) generated_max[h] = fmaxf(generated_max[h], s[nt][i]);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float new_mg = fmaxf(mg[h], row_max(generated_max[h]));
        lg[h] *= exp2_weight(mg[h], new_mg);
        mg[h] = new_mg;
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int h = i >> 1, j = j0 + 8 * nt + 2 * t + (i & 1);
          if (j >= generated_lo[h]) lg[h] += exp2_weight(s[nt][i], mg[h]);
        }
      }
    }
    if (p.relative_scores != nullptr) {
      // m is now at least every score of this warp's 16 keys (one relative-score group) and at most the row's lse.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (g + 8 * h >= vectors || j0 >= generated_lo[h]) continue;  // no input key in this group
        const int64_t row = score_row[h];
        if (j0 + 16 > lo[h]) {
          // Keys 2t, 2t + 1, 8 + 2t, 9 + 2t of the group: slots 4t to 4t + 3 (relative_score_slot).
          const uint2 lane_scores = make_uint2(pack2<__half>(s[0][2 * h] - m[h], s[0][2 * h + 1] - m[h]),
                                               pack2<__half>(s[1][2 * h] - m[h], s[1][2 * h + 1] - m[h]));
          *reinterpret_cast<uint2*>(p.relative_scores + row * relative_score_stride(p.keys) + begin + j0 + 4 * t) =
              lane_scores;
        }
        if (t == 0) {
          p.score_maxima[row * ceil_div(p.keys, kRelativeScoreGroup) + (begin + j0) / kRelativeScoreGroup] = m[h];
        }
      }
    }
    // Weights in fp32 for the sums; rounded to T for PV: the two n8 C tiles are the k16 A fragment.
    uint32_t pa[4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      float w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w[i] = exp2_weight(s[nt][i], m[i >> 1]);
        l[i >> 1] += w[i];
      }
      pa[2 * nt] = pack2<T>(w[0], w[1]);
      pa[2 * nt + 1] = pack2<T>(w[2], w[3]);
    }
    if (WITH_V) {
      // O = O * factor + P V. Where a row's max stayed, its factor is 1 (or 0 on outputs still 0, while it is -inf):
      // the scaling, a multiply per output register, waits for a row of the warp whose max rose.
      if (__any_sync(0xffffffffu, max_rose)) {
#pragma unroll
        for (int n = 0; n < NTILES; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[n][i] *= factor[i >> 1];
        }
      }
      // Lane i of ldmatrix names key (i % 8) + 8 ((i / 8) % 2) at columns 8 (i / 16) of the pair of n8 tiles:
      // registers {0, 1} are B of the first n8 tile, {2, 3} of the second.
      const T* v_lane = v_tile + ((lane & 7) + 8 * ((lane >> 3) & 1)) * PITCH + 8 * (lane >> 4);
#pragma unroll
      for (int n = 0; n < NTILES; n += 2) {
        uint32_t vb[4];
        ldmatrix_x4<true>(vb, v_lane + 8 * n);
        mma16816<T>(acc[n], pa, vb[0], vb[1]);
        mma16816<T>(acc[n + 1], pa, vb[2], vb[3]);
      }
    }
  }
  copy_async_wait<0>();  // only empty groups remain, but the stages are reused below
  __syncthreads();

  // Merge the warps' states (each relative to its own max) per vector, as the combine pass merges splits.
  float* merge_stats = reinterpret_cast<float*>(stages);           // [kMmaWarps][kMmaRows][4]
  float* merge_acc = merge_stats + kMmaWarps * kMmaRows * 4;       // [kMmaWarps][kMmaRows][DIM] with V
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int offset = 1; offset < 4; offset <<= 1) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], offset);
      lg[h] += __shfl_xor_sync(0xffffffffu, lg[h], offset);
    }
    const int at = warp * kMmaRows + g + 8 * h;
    if (t == 0) {
      merge_stats[4 * at] = m[h];
      merge_stats[4 * at + 1] = l[h];
      merge_stats[4 * at + 2] = mg[h];
      merge_stats[4 * at + 3] = lg[h];
    }
    if (WITH_V) {
#pragma unroll
      for (int n = 0; n < NTILES; ++n) {
        merge_acc[at * DIM + 8 * n + 2 * t] = acc[n][2 * h];
        merge_acc[at * DIM + 8 * n + 2 * t + 1] = acc[n][2 * h + 1];
      }
    }
  }
  __syncthreads();
  // Thread e of the block: vector e / (kMmaThreads / kMmaRows), columns strided by kMmaThreads / kMmaRows.
  constexpr int kPerVector = kMmaThreads / kMmaRows;
  const int vector = threadIdx.x / kPerVector, part = threadIdx.x % kPerVector;
  if (vector >= vectors) return;
  SoftmaxState all, generated;
  for (int w = 0; w < kMmaWarps; ++w) {
    const float* stats = merge_stats + 4 * (w * kMmaRows + vector);
    all.merge(stats[0], stats[1]);
    generated.merge(stats[2], stats[3]);
  }
  const int64_t row = (b * p.heads + head0 + vector / block_rows) * p.rows + row0 + vector % block_rows;
  if (part == 0) {
    float* stats = p.part_stats + (row * p.splits + split) * 4;
    stats[0] = all.m;
    stats[1] = all.l;
    stats[2] = generated.m;
    stats[3] = generated.l;
  }
  if (WITH_V) {
    float* out = p.part_acc + (row * p.splits + split) * DIM;
    for (int d = part; d < DIM; d += kPerVector) {
      float total = 0.0f;
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) {
        total = fmaf(exp2_weight(merge_stats[4 * (w * kMmaRows + vector)], all.m),
                     merge_acc[(w * kMmaRows + vector) * DIM + d], total);
      }
      out[d] = total;
    }
  }
}

// Launches mma_split_kernel on `stream` for a policy from mma_policy (defined and instantiated for fp16 and bf16 in
// kernel.cu; float is refused by mma_fits and has no instantiation to link); the combine pass follows in split_kv.
template <typename T, bool WITH_V>
cudaError_t mma_split(const SplitParams<T>& p, cudaStream_t stream);

}  // namespace macs

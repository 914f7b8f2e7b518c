// The split-KV pass's tile policy, in one place (like Liger-Kernel's calculate_settings): keys per tile,
// query rows per block, threads, shared memory and the number of splits. Host code (the launchers) and
// the kernels read the same functions.
#pragma once

#include "common.cuh"

namespace macs {

// The split kernels of pass 1, chosen by shape (SplitShape in launch_utils.h): the tensor-core one
// (split_kv_mma/kernel.cuh) where it takes the shape and its block fits the GPU's shared memory, else the pipelined
// one (split_kv_pipelined/kernel.cuh) on the same terms, else split_kernel (split_kv/kernel.cuh), whose only limit
// is its block's shared memory.
enum class SplitKernel : int { kGeneral, kPipelined, kMma };

constexpr int kTileKeys = 32;         // one key per lane in the per-row softmax step
constexpr int kMaxAccumulators = 16;  // output elements per thread: vectors * D_v <= threads * 16
constexpr int kMaxSplitThreads = 256;
constexpr int kCombineThreads = 128;
constexpr int kCombineChunk = 16;  // splits whose partial outputs a combine thread loads at once
// A block's query vectors (query heads of one KV head times query rows) times D_v: the output registers.
constexpr int64_t kMaxVectorsTimesDimV = int64_t(kMaxSplitThreads) * kMaxAccumulators;
// Split blocks per multiprocessor. Each block keeps one K (and V) tile of 32 keys in flight, so bandwidth needs
// several resident blocks per SM: at 2 per SM (the Triton launcher's rule, whose programs pipeline three 64-key
// tiles) this kernel read 0.3-0.55 TB/s on an H200 at 64k keys against Triton's 1.7-3.4. A decode block at D = 128
// takes about 35 KB of shared memory (6 fit in an SM's 228 KB), so 4 stay within one wave there; larger blocks
// (macs_pool's 64 vectors, about 59 KB) run in two. On the H200 4 read 1.1-1.7x faster than 2 at 64k keys.
constexpr int64_t kSplitBlocksPerSM = 4;
// Query rows of one sequence are gathered into a block up to this many vectors (without V): more rows
// share each K tile, and shared memory stays bounded.
constexpr int64_t kMaxVectorsPerBlock = 64;

// Odd row pitch: the 32 lanes of a warp read 32 different keys at the same d without bank conflicts.
__host__ __device__ inline int64_t key_pitch(int64_t dim) { return dim | 1; }

// Shared memory of a block with `block_rows` query rows of `group` query heads each: the rows' key ranges
// (int64, first), then q, the K tile, the V tile, the tile's weights and five per-vector scalars.
__host__ __device__ inline size_t split_smem_bytes(int64_t group, int64_t block_rows, int64_t dim, int64_t dim_v,
                                                   bool with_v) {
  const int64_t vectors = group * block_rows;
  const int64_t floats = vectors * dim + kTileKeys * key_pitch(dim) + (with_v ? kTileKeys * dim_v : 0) +
                         vectors * kTileKeys + 5 * vectors;
  return size_t(3 * block_rows) * sizeof(int64_t) + size_t(floats) * sizeof(float);
}

__host__ __device__ inline int split_threads(int64_t vectors, int64_t dim_v) {
  return vectors * dim_v <= 128 * kMaxAccumulators ? 128 : kMaxSplitThreads;
}

struct SplitPolicy {
  int64_t rows_per_block;  // query rows of one sequence per block, each with all query heads of the KV head
  int64_t row_chunks;      // blocks along the query rows of one sequence and KV head
  int64_t splits;          // blocks along the keys
  int threads;
  size_t smem_bytes;
  // The split kernel this policy is for; pipelined_split_kernel's (split_kv_pipelined/kernel.cuh) and
  // mma_split_kernel's: keys per staged tile and the key groups that share each tile; split_kernel's tiles are
  // kTileKeys.
  SplitKernel kernel = SplitKernel::kGeneral;
  int64_t tile_keys = kTileKeys, key_groups = 1;
};

__host__ inline SplitPolicy split_policy(int64_t batch, int64_t heads, int64_t kv_heads, int64_t rows, int64_t keys,
                                         int64_t dim, int64_t dim_v, bool with_v, int64_t sm_count) {
  const int64_t group = heads / kv_heads;
  const int64_t fit = with_v ? kMaxVectorsTimesDimV / (group * dim_v > 0 ? group * dim_v : 1)
                             : kMaxVectorsPerBlock / group;
  SplitPolicy policy;
  policy.rows_per_block = fit < 1 ? 1 : (fit < rows ? fit : (rows < 1 ? 1 : rows));
  policy.row_chunks = ceil_div(rows < 1 ? 1 : rows, policy.rows_per_block);
  const int64_t wanted = ceil_div(kSplitBlocksPerSM * sm_count, batch * kv_heads * policy.row_chunks);
  const int64_t tiles = ceil_div(keys, kTileKeys);
  policy.splits = wanted < tiles ? wanted : tiles;
  if (policy.splits < 1) policy.splits = 1;
  policy.threads = split_threads(group * policy.rows_per_block, with_v ? dim_v : 0);
  policy.smem_bytes = split_smem_bytes(group, policy.rows_per_block, dim, dim_v, with_v);
  return policy;
}

}  // namespace macs

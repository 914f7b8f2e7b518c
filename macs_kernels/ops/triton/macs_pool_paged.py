"""macs_pool_paged in Triton: macs_pool's split-KV pass reading keys through the block table."""
from __future__ import annotations

from macs_kernels.ops.triton.macs_pool import macs_pool


def macs_pool_paged(q, k_pages, block_table, out, input_start, input_end, kv_len, scale, pooling, redistribute,
                    lse, score_start=None, softcap=None, sinks=None):
    """q (B, H, R, D), k_pages (P, page_size, H_kv, D), block_table (B, pages) int32, ranges (B, R) int32 or
    int64 (any strides), out (B, R, N_max) float32 written; lse (B, H, R) or None; score_start, softcap, sinks: as
    macs_pool takes them."""
    macs_pool(q, k_pages, out, input_start, input_end, kv_len, scale, pooling, redistribute, lse, score_start,
              softcap, sinks, block_table=block_table)

"""macs_pool in Triton: the split-KV pass without V over R query rows per sequence, then the head pooling
written out before the floor."""
from __future__ import annotations

from macs_kernels.ops._checks import as_row_block
from macs_kernels.ops.triton.split_kv import fused_pass


def macs_pool(q, k_cache, out, input_start, input_end, kv_len, scale, pooling, redistribute, lse, score_start=None,
              softcap=None, sinks=None, block_table=None):
    """q (B, H, R, D), ranges (B, R) int32 or int64 (any strides), out (B, R, N_max) float32 written; lse (B, H, R)
    or None; or one row per item, q (B, H, D), ranges (B,), out (B, N_max), lse (B, H). k_cache (B, H_kv, S, D), or
    (P, page_size, H_kv, D) pages read through block_table (B, pages) int32.
    score_start (B, R) contiguous, softcap, sinks (H,): the layer's attention variant in key slots, as
    torch_backend.macs_pool takes it (ops.Variant.key_slots makes them of a window and key_offset)."""
    q, out, lse, input_start, input_end, kv_len, score_start = as_row_block(
        q, out, lse, input_start, input_end, kv_len, score_start)
    fused_pass(q, k_cache, None, input_start, input_end, kv_len, scale, out,
               pool_start=input_start if score_start is None else score_start, lse=lse, pooling=pooling,
               redistribute=redistribute, into_log_c=False, block_table=block_table, score_start=score_start,
               softcap=softcap, sinks=sinks)

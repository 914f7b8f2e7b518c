"""macs_pool in Triton: the split-KV pass without V over R query rows per sequence, then the head pooling
written out before the floor."""
from __future__ import annotations

from ..torch_backend import window_ranges
from .pool import pool
from .split_kv import split_kv_pass


def macs_pool(q, k_cache, out, input_start, input_end, kv_len, scale, pooling, redistribute, lse, block_table=None):
    """q (B, H, R, D), ranges (B, R) int64 contiguous, out (B, R, N_max) float32 written; lse (B, H, R) or None.
    k_cache (B, H_kv, S, D), or (P, page_size, H_kv, D) pages read through block_table (B, pages) int32."""
    _, own_lse, lse_gen, scores = split_kv_pass(
        q, k_cache, None, input_start, input_end, kv_len, scale, n_scores=out.shape[-1], block_table=block_table
    )
    pool(scores, out, input_start, input_end, lse=own_lse if lse is None else lse, generated=lse_gen,
         pooling=pooling, redistribute=redistribute, into_log_c=False)


def macs_pool_variant(q, k_cache, out, input_start, input_end, kv_len, scale, pooling, redistribute, lse=None, *,
                      key_offset=0, window=None, softcap=None, sinks=None):
    """torch_backend.macs_pool_variant in Triton: ranges (B, R) in token positions over a cache whose slot 0
    holds token key_offset (an int or (B, R)), a sliding window, a softcap and (H,) sinks."""
    attend, start, end, length = (bound.contiguous() for bound in window_ranges(
        input_start, input_end, kv_len, key_offset, window))
    _, own_lse, lse_gen, scores = split_kv_pass(
        q, k_cache, None, attend, end, length, scale, n_scores=out.shape[-1], score_start=start, softcap=softcap,
        sinks=sinks,
    )
    pool(scores, out, start, end, lse=own_lse if lse is None else lse, generated=lse_gen, pooling=pooling,
         redistribute=redistribute, into_log_c=False)

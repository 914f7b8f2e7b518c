"""decode_attention in Triton: the split-KV pass with V for one query per sequence and, from the same read
of K, the head pooling into log_c (macs_update) or into a pooled buffer (macs_pool's m')."""
from __future__ import annotations

from .pool import pool
from .split_kv import split_kv_pass


def decode_attention(
    q, k_cache, v_cache, kv_start, kv_len, scale, log_c, input_end, alpha, pooling, redistribute, pooled=None
):
    """out (B, H, D) in q's dtype and lse (B, H) float32; with log_c or pooled (B, N_max), also the MACS
    update or m' (input_start = kv_start).

    q may be any view with unit last stride (transformers' query[:, :, -1, :] is one); it is not copied.
    """
    state = log_c if pooled is None else pooled
    start, length = kv_start[:, None], kv_len[:, None]
    end = length if state is None else input_end[:, None]
    out, lse, lse_gen, scores = split_kv_pass(
        q[:, :, None], k_cache, v_cache, start, end, length, scale, n_scores=0 if state is None else state.shape[1]
    )
    if state is not None:
        pool(scores, state, start, end, lse=lse, generated=lse_gen, alpha=alpha, pooling=pooling,
             redistribute=redistribute, into_log_c=pooled is None)
    return out[:, :, 0], lse[:, :, 0]

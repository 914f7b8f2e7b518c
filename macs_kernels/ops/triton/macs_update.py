"""MACS update from q and the key cache: decode_attention's split-KV pass without V, then the pool.

One pass over K whether or not lse is given: the pass computes each head's log-sum-exp and the
generated keys' share alongside the scores; a given lse (FlashAttention's) replaces the computed one
in p = exp(s - lse), as the op's contract says.
"""
from __future__ import annotations

from .decode_attention import split_kv_pass
from .macs_update_rows import pool_into_log_c


def macs_update(q, k_cache, log_c, *, input_start, input_end, kv_len, scale, alpha, pooling, redistribute, lse):
    """q (B, H, D), k_cache (B, H_kv, S, D); log_c (B, N_max) float32 updated in place; lse (B, H) or None."""
    _, own_lse, lse_gen, scores = split_kv_pass(
        q, k_cache, None, kv_start=input_start, input_end=input_end, kv_len=kv_len, scale=scale,
        n_scores=log_c.shape[1],
    )
    pool_into_log_c(
        scores, log_c, input_start=input_start, input_end=input_end, lse=own_lse if lse is None else lse,
        lse_gen=lse_gen, alpha=alpha, pooling=pooling, redistribute=redistribute,
    )

"""macs_update in Triton: the split-KV pass without V, then the head pooling into log_c.

One pass over K whether or not lse is given: the pass computes each head's log-sum-exp and the generated
keys' share alongside the scores; a given lse (FlashAttention's) replaces the computed one in
p = exp(s - lse), as the op's contract says.
"""
from __future__ import annotations

from macs_kernels.ops.triton.split_kv import fused_pass


def macs_update(q, k_cache, log_c, input_start, input_end, kv_len, scale, alpha, pooling, redistribute, lse):
    """q (B, H, D), k_cache (B, H_kv, S, D); log_c (B, N_max) float32 updated in place; lse (B, H) or None."""
    start, end, length = (index[:, None] for index in (input_start, input_end, kv_len))
    fused_pass(q[:, :, None], k_cache, None, start, end, length, scale, log_c, pool_start=start,
               lse=None if lse is None else lse[:, :, None], alpha=alpha, pooling=pooling, redistribute=redistribute,
               into_log_c=True)

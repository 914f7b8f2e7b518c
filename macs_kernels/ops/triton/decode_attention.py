"""decode_attention in Triton: the split-KV pass with V for one query per sequence and, from the same read
of K, the head pooling into log_c (macs_update) or into a pooled buffer (macs_pool's m')."""
from __future__ import annotations

from macs_kernels.ops.torch.backend import window_ranges
from macs_kernels.ops.triton.split_kv import fused_pass, split_kv_pass


def decode_attention(
    q, k_cache, v_cache, kv_start, kv_len, scale, log_c, input_end, alpha, pooling, redistribute, pooled
):
    """out (B, H, D) in q's dtype and lse (B, H) float32; with log_c or pooled (B, N_max), also the MACS
    update or m' (input_start = kv_start).

    q may be any view with unit last stride (transformers' query[:, :, -1, :] is one); it is not copied.
    """
    state = log_c if pooled is None else pooled
    start, length = kv_start[:, None], kv_len[:, None]
    end = length if state is None else input_end[:, None]
    if state is None:
        out, lse, _, _ = split_kv_pass(q[:, :, None], k_cache, v_cache, start, end, length, scale, n_scores=0)
    else:
        out, lse = fused_pass(q[:, :, None], k_cache, v_cache, start, end, length, scale, state, pool_start=start,
                              alpha=alpha, pooling=pooling, redistribute=redistribute, into_log_c=pooled is None)
    return out[:, :, 0], lse[:, :, 0]


def decode_attention_variant(q, k_cache, v_cache, kv_start, kv_len, scale, input_end, pooling, redistribute, pooled,
                             *, key_offset=0, window=None, softcap=None, sinks=None):
    """torch_backend.decode_attention_variant in Triton: the output and lse of a layer with an attention variant
    and, with pooled (B, N_max), its m' (positions in tokens; see macs_pool_variant)."""
    end = kv_len if input_end is None else input_end
    attend, start, end, length = (bound[:, None].contiguous() for bound in window_ranges(
        kv_start, end, kv_len, key_offset, window))
    variant = dict(score_start=start, softcap=softcap, sinks=sinks)
    if pooled is None:
        out, lse, _, _ = split_kv_pass(q[:, :, None], k_cache, v_cache, attend, end, length, scale, n_scores=0,
                                       **variant)
    else:
        out, lse = fused_pass(q[:, :, None], k_cache, v_cache, attend, end, length, scale, pooled, pool_start=start,
                              pooling=pooling, redistribute=redistribute, into_log_c=False, **variant)
    return out[:, :, 0], lse[:, :, 0]

"""decode_attention in Triton: the split-KV pass with V for one query per sequence and, from the same read
of K, the head pooling into log_c (macs_update) or into a pooled buffer (macs_pool's m')."""
from __future__ import annotations

from macs_kernels.ops.triton.split_kv import fused_pass, split_kv_pass


def decode_attention(
    q, k_cache, v_cache, kv_start, kv_len, scale, log_c, input_end, alpha, pooling, redistribute, pooled,
    score_start=None, softcap=None, sinks=None,
):
    """out (B, H, D_v) in q's dtype and lse (B, H) float32; with log_c or pooled (B, N_max), also the MACS
    update or m' (input_start = kv_start).

    score_start (B,), softcap, sinks (H,): the layer's attention variant in key slots, as
    torch_backend.decode_attention takes it (ops.Variant.key_slots makes them; score_start with pooled only): the
    output and lse are the variant's and, with pooled, its m'.

    q may be any view with unit last stride (transformers' query[:, :, -1, :] is one); it is not copied.
    """
    if score_start is not None and log_c is not None:
        raise ValueError("decode_attention: score_start (a sliding window's input columns) comes with pooled, "
                         "not log_c")
    if score_start is not None or softcap is not None or sinks is not None:
        return _variant(q, k_cache, v_cache, kv_start, kv_len, scale, input_end, pooling, redistribute, pooled,
                        kv_start if score_start is None else score_start, softcap, sinks)
    state = log_c if pooled is None else pooled
    start, length = kv_start[:, None], kv_len[:, None]
    end = length if state is None else input_end[:, None]
    if state is None:
        out, lse, _, _ = split_kv_pass(q[:, :, None], k_cache, v_cache, start, end, length, scale, n_scores=0)
    else:
        out, lse = fused_pass(q[:, :, None], k_cache, v_cache, start, end, length, scale, state, pool_start=start,
                              alpha=alpha, pooling=pooling, redistribute=redistribute, into_log_c=pooled is None)
    return out[:, :, 0], lse[:, :, 0]


def _variant(q, k_cache, v_cache, attend, kv_len, scale, input_end, pooling, redistribute, pooled, score_start,
             softcap, sinks):
    """decode_attention of a layer with an attention variant: rows attend [attend, kv_len) and, with pooled, their
    inputs are [score_start, input_end) (a window's first inputs may precede the attended start)."""
    end = kv_len if input_end is None else input_end
    attend, start, end, length = (bound[:, None].contiguous() for bound in (attend, score_start, end, kv_len))
    variant = dict(score_start=start, softcap=softcap, sinks=sinks)
    if pooled is None:
        out, lse, _, _ = split_kv_pass(q[:, :, None], k_cache, v_cache, attend, end, length, scale, n_scores=0,
                                       **variant)
    else:
        out, lse = fused_pass(q[:, :, None], k_cache, v_cache, attend, end, length, scale, pooled, pool_start=start,
                              pooling=pooling, redistribute=redistribute, into_log_c=False, **variant)
    return out[:, :, 0], lse[:, :, 0]

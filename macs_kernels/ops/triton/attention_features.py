"""attention_features in Triton: AT2's per-head attention of R target rows on the source keys, row-summed.

Pass 1 (`_features_lse_kernel`, only without a given lse; grid (B * H, row tiles)): each row's log-sum-exp
over its causal keys [kv_start, kv_len - n_rows + r + 1), online over key tiles.
Pass 2 (`_features_kernel`, grid (B * H, source tiles)): a program loads one tile of source keys once and
walks the row tiles that can see it: a tensor-core product gives the (rows x keys) scores, exp(s - lse)
the probabilities, and the sum over rows stays in registers; only the (B, H, N_max) result is written.
Rows before the first one whose causal window reaches the tile are skipped.

Attention variants (ops.Variant): row r attends from max(kv_start, base + r + 1 - window) (no window: a window
longer than the cache); SOFTCAP caps each score to softcap * tanh(s / softcap) before it is read; HAS_SINKS adds
each head's sink logit to the rows' log-sum-exp. Rows whose window starts after the tile are skipped too.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from macs_kernels.ops.triton.common import (
    LOG2E,
    MIN_SCORE,
    cdiv,
    clamped,
    dot,
    dot_in_f32,
    features_tiles,
    head_block,
    launch,
    operand,
)


@triton.jit
def _log2_scores(dots, scale, softcap, SOFTCAP: tl.constexpr):
    """q . k -> the layer's scores in base 2 (capped to softcap * tanh(s / softcap) first with SOFTCAP)."""
    s = dots * scale
    if SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
    return s * LOG2E


@triton.jit
def _feature_rows(kv_len_ptr, n_rows_ptr, b, rows, keys):
    """Item b's (n_rows, base): row r < n_rows ends its keys at base + r + 1. Clamped into the cache as the cuda
    kernels clamp them (csrc/attention_features/kernel.cuh, FeatureRows; a row's start into [0, base]): an unchecked
    range gives wrong numbers, never an access outside the tensors."""
    end = clamped(tl.load(kv_len_ptr + b), 0, keys)
    n_rows = clamped(tl.load(n_rows_ptr + b), 0, tl.minimum(end, rows))
    return n_rows, end - n_rows


@triton.jit
def _features_lse_kernel(
    q_ptr, k_ptr, start_ptr, kv_len_ptr, n_rows_ptr, lse_ptr, sinks_ptr,
    scale, softcap, window, heads, group, rows, keys,
    stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # Inductor passes Python floats as fp64 (a loop-carried max would turn fp64): the math stays fp32.
    scale, softcap = tl.cast(scale, tl.float32), tl.cast(softcap, tl.float32)
    pid = tl.program_id(0)
    b = (pid // heads).to(tl.int64)
    h = (pid % heads).to(tl.int64)
    kv_head = h // group
    n_rows, base = _feature_rows(kv_len_ptr, n_rows_ptr, b, rows, keys)
    start = clamped(tl.load(start_ptr + b), 0, base)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    row_ok = r < n_rows
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + r[:, None] * stride_qr + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    q = operand(q, DOT_F32)
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    m = tl.full([BLOCK_R], MIN_SCORE, tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    hi = base + tl.minimum(n_rows, tl.program_id(1) * BLOCK_R + BLOCK_R)
    lo = tl.maximum(start, base + tl.program_id(1) * BLOCK_R + 1 - window)  # the tile's first row's window
    # Row r attends keys (base + r - window, base + r]: as int32 offsets from lo clamped into [0, hi - lo], set once,
    # so that the (rows x keys) mask is one 32-bit compare per bound (an int64 compare takes two instructions).
    span = tl.maximum(hi - lo, 0)
    row_lo = clamped(base + r + 1 - window - lo, 0, span).to(tl.int32)
    row_hi = tl.where(row_ok, clamped(base + r + 1 - lo, 0, span), 0).to(tl.int32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        offset = (n0 - lo).to(tl.int32) + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + n[:, None] * stride_ks + d[None, :], mask=(n[:, None] < hi) & (d[None, :] < D), other=0.0)
        s = _log2_scores(dot(q, tl.trans(operand(k, DOT_F32)), DOT_F32), scale, softcap, SOFTCAP)
        attended = (offset[None, :] >= row_lo[:, None]) & (offset[None, :] < row_hi[:, None])
        s = tl.where(attended, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        l = l * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m = m_new
    if HAS_SINKS:  # the sink joins the denominator only
        sink = tl.load(sinks_ptr + h).to(tl.float32) * LOG2E
        m_new = tl.maximum(m, sink)
        l = l * tl.exp2(m - m_new) + tl.exp2(sink - m_new)
        m = m_new
    lse = (m + tl.log2(tl.where(row_ok, l, 1.0))) / LOG2E
    tl.store(lse_ptr + (b * heads + h) * rows + r, tl.where(row_ok, lse, 0.0), mask=r < rows)


@triton.jit
def _features_kernel(
    q_ptr, k_ptr, lse_ptr, source_start_ptr, source_end_ptr, kv_len_ptr, n_rows_ptr, out_ptr,
    scale, softcap, window, heads, group, rows, keys, n_max,
    stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks, stride_lb, stride_lh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # Inductor passes Python floats as fp64 (a loop-carried max would turn fp64): the math stays fp32.
    scale, softcap = tl.cast(scale, tl.float32), tl.cast(softcap, tl.float32)
    pid = tl.program_id(0)
    b = (pid // heads).to(tl.int64)
    h = (pid % heads).to(tl.int64)
    kv_head = h // group
    source_start = tl.load(source_start_ptr + b).to(tl.int64)
    source_end = clamped(tl.load(source_end_ptr + b), 0, keys)
    n_rows, base = _feature_rows(kv_len_ptr, n_rows_ptr, b, rows, keys)
    i = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tile0 = source_start + tl.program_id(1) * BLOCK_N
    n = source_start + i
    d = tl.arange(0, BLOCK_D)
    key_ok = (n >= 0) & (n < source_end)
    # Keys and rows' bounds as int32 offsets j from the tile's first key, clamped into [0, BLOCK_N]: the (rows x keys)
    # mask is then one 32-bit compare per bound (an int64 compare takes two instructions).
    j = tl.arange(0, BLOCK_N)
    key_lo = clamped(-tile0, 0, BLOCK_N).to(tl.int32)
    key_hi = clamped(source_end - tile0, 0, BLOCK_N).to(tl.int32)
    k = tl.load(k_ptr + b * stride_kb + kv_head * stride_kh + n[:, None] * stride_ks + d[None, :],
                mask=key_ok[:, None] & (d[None, :] < D), other=0.0)
    k = operand(k, DOT_F32)
    acc = tl.zeros([BLOCK_N], tl.float32)
    # Row r sees key n when base + r - window < n <= base + r: rows before the tile's first key minus base, and
    # those whose window starts after its last key, see none of it.
    first = tl.maximum(source_start + tl.program_id(1) * BLOCK_N - base, 0)
    last = tl.minimum(n_rows, source_start + tl.program_id(1) * BLOCK_N + BLOCK_N - 1 - base + window)
    for r0 in range((first // BLOCK_R) * BLOCK_R, last, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        row_ok = r < n_rows
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + r[:, None] * stride_qr + d[None, :],
                    mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
        if DOT_F32:
            # CUDA-core products as k . q^T: as q . k^T, with k held across the row tiles, even (16, 16) tiles spilled
            # (240-264 bytes a thread at D = 128). The transpose costs nothing: the compiler takes its layout.
            s = _log2_scores(tl.trans(dot(k, tl.trans(operand(q, DOT_F32)), DOT_F32)), scale, softcap, SOFTCAP)
        else:
            s = _log2_scores(dot(q, tl.trans(k), DOT_F32), scale, softcap, SOFTCAP)
        lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + r, mask=row_ok, other=0.0)
        p = tl.exp2(s - lse[:, None] * LOG2E)
        seen_lo = tl.maximum(clamped(base + r + 1 - window - tile0, 0, BLOCK_N).to(tl.int32), key_lo)
        seen_hi = tl.minimum(tl.where(row_ok, clamped(base + r + 1 - tile0, 0, BLOCK_N), 0).to(tl.int32), key_hi)
        seen = (j[None, :] >= seen_lo[:, None]) & (j[None, :] < seen_hi[:, None])
        acc += tl.sum(tl.where(seen, p, 0.0), axis=0)
    tl.store(out_ptr + (b * heads + h) * n_max + i, acc, mask=i < n_max)


def attention_features(q, k_cache, source_start, source_end, kv_start, kv_len, n_rows, n_max, scale, lse, window=None,
                       softcap=None, sinks=None):
    """q (B, H, R, D), k_cache (B, H_kv, S, D) -> (B, H, N_max) float32; lse (B, H, R) or None; window, softcap,
    sinks (H,): the layer's variant (ops.Variant)."""
    batch, heads, rows, dim = q.shape
    group = heads // k_cache.shape[1]
    dot_f32 = dot_in_f32(q, k_cache)
    block_d = head_block(dim)
    block_r, block_n = features_tiles(rows, dot_f32)
    strides = (q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    consts = dict(D=dim, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_N=block_n, DOT_F32=dot_f32,
                  SOFTCAP=softcap is not None, num_warps=4)
    # No window: one longer than the cache, which no row's range reaches.
    variant = (scale, 1.0 if softcap is None else float(softcap), k_cache.shape[2] + 1 if window is None else window)
    if lse is None:
        lse = torch.empty(batch, heads, rows, device=q.device, dtype=torch.float32)
        sink_logits = lse if sinks is None else sinks.float().contiguous()
        launch(_features_lse_kernel, (batch * heads, cdiv(rows, block_r)),
               q, k_cache, kv_start, kv_len, n_rows, lse, sink_logits, *variant, heads, group, rows, k_cache.shape[2],
               *strides,
               HAS_SINKS=sinks is not None, **consts)
    else:
        lse = lse.float()
        if lse.stride(-1) != 1:
            lse = lse.contiguous()
    out = torch.empty(batch, heads, n_max, device=q.device, dtype=torch.float32)
    launch(_features_kernel, (batch * heads, cdiv(n_max, block_n)),
           q, k_cache, lse, source_start, source_end, kv_len, n_rows, out, *variant, heads, group, rows,
           k_cache.shape[2], n_max,
           *strides, lse.stride(0), lse.stride(1), **consts)
    return out

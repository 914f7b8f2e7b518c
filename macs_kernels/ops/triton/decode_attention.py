"""Split-KV flash-decoding of one query per sequence, optionally fused with the MACS update.

Pass 1 (`_decode_split_kernel`, grid (B * H_kv, splits)): one program owns a GQA group (the G query
heads that read one KV head, padded to 16 rows for tl.dot) and one slice of the keys, so each K/V tile
is loaded once for the whole group. It keeps an online softmax (max m, mass l) and, in the same
registers, the mass l_gen of the generated keys [input_end, kv_len): exp(lse_gen - lse) is then a
head's attention on generated tokens without a second pass over K. With MACS on, it also writes the
scores of the input keys (B, H, N_max) float32: H x N x 4 bytes, against H_kv x S x 2D bytes of K.
Pass 2 (`_decode_combine_kernel`, grid (B * H,)): merges the slices into lse, lse_gen and out.
Pass 3 (macs_update_rows.py's pool kernel) turns scores, lse and lse_gen into the log_c update.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import interpreted, launch, multiprocessors, next_pow2
from .macs_update_rows import pool_into_log_c


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, start_ptr, input_end_ptr, kv_len_ptr,
    scores_ptr, m_ptr, l_ptr, l_gen_ptr, acc_ptr,
    scale, split_size, splits, kv_heads,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_sb, stride_sh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, WITH_V: tl.constexpr, WITH_SCORES: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // kv_heads).to(tl.int64)
    kv_head = (pid % kv_heads).to(tl.int64)
    start = tl.load(start_ptr + b)
    input_end = tl.load(input_end_ptr + b)
    kv_len = tl.load(kv_len_ptr + b)
    lo = tl.maximum(start, split * split_size)
    hi = tl.minimum(kv_len, (split + 1) * split_size)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < D
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        # Also the interpreter's path: its bf16 dot and arithmetic are wrong.
        q = q.to(tl.float32)
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    l_gen = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        # Masked keys load as 0, not as whatever an unused cache slot holds (0 * NaN would poison the dot).
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + n[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(n_mask[None, :], s * scale, float("-inf"))
        if WITH_SCORES:
            is_input = n_mask & (n < input_end)
            tl.store(scores_ptr + b * stride_sb + heads[:, None] * stride_sh + (n - start)[None, :], s,
                     mask=g_mask[:, None] & is_input[None, :])
        m_new = tl.maximum(m, tl.max(s, 1))
        correction = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * correction + tl.sum(p, 1)
        l_gen = l_gen * correction + tl.sum(tl.where((n >= input_end)[None, :], p, 0.0), 1)
        if WITH_V:
            v = tl.load(v_base + n[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)
            if DOT_F32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * correction[:, None] + pv
        m = m_new

    partial = (b * kv_heads * GROUP + heads) * splits + split
    tl.store(m_ptr + partial, m, mask=g_mask)
    tl.store(l_ptr + partial, l, mask=g_mask)
    tl.store(l_gen_ptr + partial, l_gen, mask=g_mask)
    if WITH_V:
        tl.store(acc_ptr + partial[:, None] * D + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_combine_kernel(
    m_ptr, l_ptr, l_gen_ptr, acc_ptr, out_ptr, lse_ptr, lse_gen_ptr,
    splits, heads, stride_ob, stride_oh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, WITH_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SPLITS_PAD)
    sp_mask = sp < splits
    m = tl.load(m_ptr + row * splits + sp, mask=sp_mask, other=float("-inf"))
    top = tl.max(m, 0)
    # Empty slices have m = -inf and weigh 0; every row attends at least one key, so top is finite.
    weight = tl.exp(m - top)
    l = tl.sum(weight * tl.load(l_ptr + row * splits + sp, mask=sp_mask, other=0.0), 0)
    l_gen = tl.sum(weight * tl.load(l_gen_ptr + row * splits + sp, mask=sp_mask, other=0.0), 0)
    tl.store(lse_ptr + row, top + tl.log(l))
    tl.store(lse_gen_ptr + row, top + tl.log(l_gen))
    if WITH_V:
        d = tl.arange(0, BLOCK_D)
        acc = tl.load(acc_ptr + (row * splits + sp)[:, None] * D + d[None, :],
                      mask=sp_mask[:, None] & (d < D)[None, :], other=0.0)
        out = tl.sum(weight[:, None] * acc, 0) / l
        tl.store(out_ptr + (row // heads) * stride_ob + (row % heads) * stride_oh + d,
                 out.to(out_ptr.dtype.element_ty), mask=d < D)


def _plan_splits(batch, kv_heads, keys, block_n, device):
    """(splits, keys per split): enough programs to fill the GPU twice over, whole blocks per split."""
    blocks = triton.cdiv(keys, block_n)
    splits = min(blocks, max(1, triton.cdiv(2 * multiprocessors(device), batch * kv_heads)))
    per_split = triton.cdiv(blocks, splits)
    return triton.cdiv(blocks, per_split), per_split * block_n


def split_kv_pass(q, k_cache, v_cache, *, kv_start, input_end, kv_len, scale, n_scores):
    """Passes 1 and 2. v_cache None skips out; n_scores > 0 also returns the input keys' scores.

    Returns (out (B, H, D) in q's dtype or None, lse (B, H) float32, lse_gen (B, H) float32 (-inf where
    no generated key), scores (B, H, n_scores) float32 or None: score of key kv_start + i in column i).
    """
    batch, heads, dim = q.shape
    kv_heads, keys = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    with_v = v_cache is not None
    half = q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype
    dot_f32 = interpreted() or not (half and (not with_v or v_cache.dtype == q.dtype))
    block_n = 128 if interpreted() else 64
    splits, split_size = _plan_splits(batch, kv_heads, keys, block_n, q.device)
    f32 = dict(device=q.device, dtype=torch.float32)
    m, l, l_gen = (torch.empty(batch, heads, splits, **f32) for _ in range(3))
    acc = torch.empty(batch, heads, splits, dim, **f32) if with_v else m
    scores = torch.empty(batch, heads, n_scores, **f32) if n_scores else m
    v = v_cache if with_v else k_cache
    block_d = next_pow2(dim)
    launch(
        _decode_split_kernel, (batch * kv_heads, splits),
        q, k_cache, v, kv_start, input_end, kv_len, scores, m, l, l_gen, acc,
        scale, split_size, splits, kv_heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v.stride(0), v.stride(1), v.stride(2), scores.stride(0), scores.stride(1),
        D=dim, BLOCK_D=block_d, GROUP=group, G_PAD=max(16, next_pow2(group)), BLOCK_N=block_n,
        WITH_V=with_v, WITH_SCORES=bool(n_scores), DOT_F32=dot_f32, num_warps=4, num_stages=3,
    )
    out = torch.empty(batch, heads, dim, device=q.device, dtype=q.dtype) if with_v else None
    lse, lse_gen = (torch.empty(batch, heads, **f32) for _ in range(2))
    launch(
        _decode_combine_kernel, (batch * heads,),
        m, l, l_gen, acc, out if with_v else lse, lse, lse_gen,
        splits, heads, out.stride(0) if with_v else 0, out.stride(1) if with_v else 0,
        D=dim, BLOCK_D=block_d, SPLITS_PAD=next_pow2(splits), WITH_V=with_v, num_warps=4,
    )
    return out, lse, lse_gen, scores if n_scores else None


def decode_attention(
    q, k_cache, v_cache, *, kv_start, kv_len, scale, log_c, input_end, alpha, pooling, redistribute, pooled=None
):
    """out (B, H, D) in q's dtype and lse (B, H) float32; with log_c, also macs_update (input_start = kv_start).

    q may be any view with unit last stride (transformers' query[:, :, -1, :] is one); it is not copied.
    """
    if pooled is not None:
        raise NotImplementedError("the triton decode kernel has no pooled mode yet; use backend='torch'")
    fused = log_c is not None
    out, lse, lse_gen, scores = split_kv_pass(
        q, k_cache, v_cache, kv_start=kv_start, input_end=input_end if fused else kv_len, kv_len=kv_len,
        scale=scale, n_scores=log_c.shape[1] if fused else 0,
    )
    if fused:
        pool_into_log_c(
            scores, log_c, input_start=kv_start, input_end=input_end, lse=lse, lse_gen=lse_gen,
            alpha=alpha, pooling=pooling, redistribute=redistribute,
        )
    return out, lse

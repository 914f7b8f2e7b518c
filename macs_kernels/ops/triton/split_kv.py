"""The split-KV pass: flash-decoding of query rows whose key ranges differ per row, shared by
decode_attention, macs_update and macs_pool.

`_split_kv_kernel` (grid (B * H_kv * row tiles, splits)): one program owns BLOCK_M rows of one KV head
(query heads of the GQA group x query rows: row m is head m % G of query m // G, padded to 16 rows for
tl.dot) and one slice of the keys, so each K/V tile is loaded once for all of them. Row (b, h, r) attends
keys [start, kv_len) of its own range; per row it keeps an online softmax (max m, mass l) and, in the same
registers, the mass l_gen of its generated keys [input_end, kv_len): exp(lse_gen - lse) is then the row's
attention on generated tokens without a second pass over K. With scores on, it writes the scores of the
input keys, key start + i in column i of (B, H, R, N_max) float32: H x R x N x 4 bytes, against
H_kv x S x 2D bytes of K.
`_split_kv_combine_kernel` (grid (B * H * R,)): merges the slices into lse, lse_gen and out.

Attention variants (ops.Variant): a sliding window is a row whose attended start lies after its input start
(its score columns count from the input start, `score_start`, which may precede the cache's first slot: the
inputs that slid out); SOFTCAP caps the scores to softcap * tanh(s / softcap) before anything else reads them;
HAS_SINKS adds each head's sink logit to the denominator in the combine (the sink attends no value).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import MIN_SCORE, cdiv, dot, dot_in_f32, head_block, launch, next_pow2, operand, split_kv_tiles


@triton.jit
def _key_slots(n, in_slice, b, block_table_ptr, stride_tb, PAGE_SIZE: tl.constexpr):
    """Where keys n of item b live: (page, slot) of a paged cache through the block table (PAGE_SIZE > 0),
    or (b, n) of a contiguous (B, H_kv, S, D) cache. Keys past the slice read no table entry: an item's
    table may end in -1s."""
    if PAGE_SIZE > 0:
        page = tl.load(block_table_ptr + b * stride_tb + n // PAGE_SIZE, mask=in_slice, other=0).to(tl.int64)
        slot = n % PAGE_SIZE
    else:
        page = tl.zeros_like(n).to(tl.int64) + b
        slot = n
    return page, slot


@triton.jit
def _split_kv_kernel(
    q_ptr, k_ptr, v_ptr, start_ptr, input_end_ptr, kv_len_ptr, block_table_ptr, score_start_ptr,
    scores_ptr, m_ptr, l_ptr, l_gen_ptr, acc_ptr,
    scale, softcap, split_size, splits, kv_heads, rows,
    stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ib, stride_ir, stride_tb, stride_sb, stride_sh, stride_sr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, WITH_V: tl.constexpr, WITH_SCORES: tl.constexpr, DOT_F32: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SOFTCAP: tl.constexpr,
):
    row_tiles = tl.cdiv(GROUP * rows, BLOCK_M)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tile = pid % row_tiles
    b = (pid // row_tiles // kv_heads).to(tl.int64)
    kv_head = (pid // row_tiles % kv_heads).to(tl.int64)

    m_index = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m_index < GROUP * rows
    head = kv_head * GROUP + m_index % GROUP
    r = m_index // GROUP
    ranges = b * stride_ib + r * stride_ir
    # Padding rows attend nothing: start = kv_len = 0.
    start = tl.load(start_ptr + ranges, mask=row_ok, other=0)
    input_end = tl.load(input_end_ptr + ranges, mask=row_ok, other=0)
    kv_len = tl.load(kv_len_ptr + ranges, mask=row_ok, other=0)
    score_start = tl.load(score_start_ptr + ranges, mask=row_ok, other=0)
    lo = tl.maximum(tl.min(tl.where(row_ok, start, 2147483647), 0), split * split_size)
    hi = tl.minimum(tl.max(kv_len, 0), (split + 1) * split_size)

    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + r[:, None] * stride_qr + d[None, :],
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    q = operand(q, DOT_F32)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh

    m = tl.full([BLOCK_M], MIN_SCORE, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    l_gen = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        # Keys past the slice load as 0, not as whatever an unused cache slot holds (0 * NaN would poison
        # the dot).
        in_slice = n < hi
        kv_mask = in_slice[:, None] & d_mask[None, :]
        page, slot = _key_slots(n, in_slice, b, block_table_ptr, stride_tb, PAGE_SIZE)
        k_rows = k_head + page * stride_kb + slot * stride_ks
        k = operand(tl.load(k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0), DOT_F32)
        attended = in_slice[None, :] & (n[None, :] >= start[:, None]) & (n[None, :] < kv_len[:, None])
        s = dot(q, tl.trans(k), DOT_F32) * scale
        if SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        s = tl.where(attended, s, float("-inf"))
        if WITH_SCORES:
            is_input = attended & (n[None, :] < input_end[:, None])
            tl.store(scores_ptr + b * stride_sb + head[:, None] * stride_sh + r[:, None] * stride_sr
                     + (n[None, :] - score_start[:, None]), s, mask=is_input)
        m_new = tl.maximum(m, tl.max(s, 1))
        correction = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * correction + tl.sum(p, 1)
        l_gen = l_gen * correction + tl.sum(tl.where(n[None, :] >= input_end[:, None], p, 0.0), 1)
        if WITH_V:
            v_rows = v_head + page * stride_vb + slot * stride_vs
            v = operand(tl.load(v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0), DOT_F32)
            acc = acc * correction[:, None] + dot(p.to(v.dtype), v, DOT_F32)
        m = m_new

    partial = ((b * kv_heads * GROUP + head) * rows + r) * splits + split
    tl.store(m_ptr + partial, m, mask=row_ok)
    tl.store(l_ptr + partial, l, mask=row_ok)
    tl.store(l_gen_ptr + partial, l_gen, mask=row_ok)
    if WITH_V:
        tl.store(acc_ptr + partial[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_mask[None, :])


@triton.jit
def _split_kv_combine_kernel(
    m_ptr, l_ptr, l_gen_ptr, acc_ptr, out_ptr, lse_ptr, lse_gen_ptr, sinks_ptr,
    splits, heads, rows, stride_ob, stride_oh, stride_or,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, WITH_V: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SPLITS_PAD)
    sp_mask = sp < splits
    m = tl.load(m_ptr + row * splits + sp, mask=sp_mask, other=MIN_SCORE)
    top = tl.max(m, 0)
    # Slices in which the row attends no key have l = 0; every row attends a key somewhere.
    weight = tl.exp(m - top)
    l = tl.sum(weight * tl.load(l_ptr + row * splits + sp, mask=sp_mask, other=0.0), 0)
    l_gen = tl.sum(weight * tl.load(l_gen_ptr + row * splits + sp, mask=sp_mask, other=0.0), 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + row // rows % heads).to(tl.float32)
        rescale = tl.exp(top - tl.maximum(top, sink))
        weight = weight * rescale
        l = l * rescale + tl.exp(sink - tl.maximum(top, sink))
        l_gen = l_gen * rescale
        top = tl.maximum(top, sink)
    tl.store(lse_ptr + row, top + tl.log(l))
    tl.store(lse_gen_ptr + row, top + tl.log(l_gen))
    if WITH_V:
        d = tl.arange(0, BLOCK_D)
        acc = tl.load(acc_ptr + (row * splits + sp)[:, None] * D + d[None, :],
                      mask=sp_mask[:, None] & (d < D)[None, :], other=0.0)
        out = tl.sum(weight[:, None] * acc, 0) / l
        target = out_ptr + row // (heads * rows) * stride_ob + row // rows % heads * stride_oh + row % rows * stride_or
        tl.store(target + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def split_kv_pass(q, k_cache, v_cache, start, input_end, kv_len, scale, n_scores, block_table=None, *,
                  score_start=None, softcap=None, sinks=None):
    """q (B, H, R, D) (any strides, unit last); ranges (B, R) int64 (a (B, 1) view may have stride 0 in R).
    score_start (B, R), same strides: where a row's score columns start when it differs from its attended start
    (a window; columns before the window stay -inf); softcap, sinks (H,): the layer's variant.
    v_cache None skips out; n_scores > 0 also returns the input keys' scores. With a block_table (B, pages)
    int32 the caches are paged, (P, page_size, H_kv, D), and key j of item b is in page
    block_table[b, j // page_size]; otherwise they are (B, H_kv, S, D).

    Returns (out (B, H, R, D) in q's dtype or None, lse (B, H, R) float32, lse_gen (B, H, R) float32 (-inf
    where no generated key), scores (B, H, R, n_scores) float32 or None).
    """
    batch, heads, rows, dim = q.shape
    paged = block_table is not None
    if paged:
        page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        keys = block_table.shape[1] * page_size
        # (item or page, head, slot) strides, the order the kernel takes for either layout.
        k_strides, v_strides = ((t.stride(0), t.stride(2), t.stride(1)) if t is not None else None
                                for t in (k_cache, v_cache))
    else:
        page_size, kv_heads, keys = 0, k_cache.shape[1], k_cache.shape[2]
        k_strides, v_strides = (t.stride()[:3] if t is not None else None for t in (k_cache, v_cache))
    group = heads // kv_heads
    with_v = v_cache is not None
    dot_f32 = dot_in_f32(q, k_cache, *((v_cache,) if with_v else ()))
    tiles = split_kv_tiles(batch, kv_heads, group * rows, keys, q.device)
    block_d = head_block(dim)
    f32 = dict(device=q.device, dtype=torch.float32)
    m, l, l_gen = (torch.empty(batch, heads, rows, tiles.splits, **f32) for _ in range(3))
    acc = torch.empty(batch, heads, rows, tiles.splits, dim, **f32) if with_v else m
    windowed = score_start is not None
    if n_scores:
        scores = (torch.full if windowed else torch.empty)(
            (batch, heads, rows, max(n_scores, 1)), *((float("-inf"),) if windowed else ()), **f32)
    else:
        scores = m
    v = v_cache if with_v else k_cache
    launch(
        _split_kv_kernel, (batch * kv_heads * cdiv(group * rows, tiles.block_m), tiles.splits),
        q, k_cache, v, start, input_end, kv_len, block_table if paged else start,
        score_start if windowed else start, scores, m, l, l_gen, acc,
        scale, 1.0 if softcap is None else float(softcap), tiles.split_size, tiles.splits, kv_heads, rows,
        q.stride(0), q.stride(1), q.stride(2), *k_strides, *(v_strides if with_v else k_strides),
        start.stride(0), start.stride(1), block_table.stride(0) if paged else 0,
        scores.stride(0), scores.stride(1), scores.stride(2),
        D=dim, BLOCK_D=block_d, GROUP=group, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        WITH_V=with_v, WITH_SCORES=bool(n_scores), DOT_F32=dot_f32, PAGE_SIZE=page_size,
        SOFTCAP=softcap is not None, num_warps=4, num_stages=3,
    )
    out = torch.empty(batch, heads, rows, dim, device=q.device, dtype=q.dtype) if with_v else None
    lse, lse_gen = (torch.empty(batch, heads, rows, **f32) for _ in range(2))
    target = out if with_v else lse
    launch(
        _split_kv_combine_kernel, (batch * heads * rows,),
        m, l, l_gen, acc, target, lse, lse_gen, m if sinks is None else sinks,
        tiles.splits, heads, rows, *(target.stride(i) if with_v else 0 for i in range(3)),
        D=dim, BLOCK_D=block_d, SPLITS_PAD=next_pow2(tiles.splits), WITH_V=with_v, HAS_SINKS=sinks is not None,
        num_warps=4,
    )
    return out, lse, lse_gen, scores if n_scores else None

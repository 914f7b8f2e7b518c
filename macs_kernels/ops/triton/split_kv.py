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

The fused MACS pass (`fused_pass`) pools the input keys' probabilities over heads after that, in one of three ways
(settings.TRITON_SPLIT_KV_PASSES): "verified", the default, launches the combine and then pool.py's `_pool_kernel`;
"two-launch" launches `_combine_pool_kernel`, the combine with the pooling folded in, and for the log c update of
half-precision inputs has the split kernel write each score as s - m in float16 (m: the row's running max after the
key block, float32 beside them), half the score bytes (benchmarks/results/triton_two_launch_pass.md); "one-launch"
launches `_one_launch_kernel` alone: the split kernel whose last arrival per row tile merges the slices and pools its
GQA group from the scores still in L2, the item's last group applying the floor (docs/backends.md).

Attention variants (ops.Variant): a sliding window is a row whose attended start lies after its input start
(its score columns count from the input start, `score_start`, which may precede the cache's first slot: the
inputs that slid out); SOFTCAP caps the scores to softcap * tanh(s / softcap) before anything else reads them;
HAS_SINKS adds each head's sink logit to the denominator in the combine (the sink attends no value).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from macs_kernels.ops.triton.common import (
    MIN_SCORE,
    ONE_LAUNCH_ROWS,
    SplitKV,
    cdiv,
    clamped,
    dot,
    dot_in_f32,
    head_block,
    input_columns,
    key_range,
    launch,
    multiprocessors,
    next_pow2,
    operand,
    pool_block,
    split_kv_tiles,
    splits_chunk,
)
from macs_kernels.ops.triton.pool import pool, pool_tile
from macs_kernels.ops.triton.settings import triton_split_kv_pass


@triton.jit
def _key_slots(n, in_slice, b, block_table_ptr, stride_tb, pages, PAGE_SIZE: tl.constexpr):
    """Where keys n of item b live: (page, slot) of a paged cache through the block table (PAGE_SIZE > 0),
    or (b, n) of a contiguous (B, H_kv, S, D) cache. Keys past the slice read no table entry: an item's
    table may end in -1s. A page number outside the `pages` pages is clamped into them, as the cuda kernels do:
    an unchecked bad table gives wrong numbers, never a read outside the cache."""
    if PAGE_SIZE > 0:
        page = tl.load(block_table_ptr + b * stride_tb + n // PAGE_SIZE, mask=in_slice, other=0).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), pages - 1)
        slot = n % PAGE_SIZE
    else:
        page = tl.zeros_like(n).to(tl.int64) + b
        slot = n
    return page, slot


@triton.jit
def _slice_offset(key, first, span):
    """int32 offset of `key` from the slice's first key, clamped into [0, span]."""
    return clamped(key - first, 0, span).to(tl.int32)


@triton.jit
def _split_slice(
    q_ptr, k_ptr, v_ptr, start_ptr, input_end_ptr, kv_len_ptr, block_table_ptr, score_start_ptr,
    scores_ptr, tile_max_ptr, scale, softcap, split_size, kv_heads, rows, key_tiles, keys, n_scores, pages,
    stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ib, stride_ir, stride_eb, stride_er, stride_lb, stride_lr, stride_fb, stride_fr,
    stride_tb, stride_sb, stride_sh, stride_sr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, WITH_V: tl.constexpr, WITH_SCORES: tl.constexpr, DOT_F32: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr, KEEP_SCORES: tl.constexpr,
):
    """One program's (row tile, key slice) of the split-KV pass: the online softmax state (m, l, l_gen, acc) of its
    BLOCK_M rows over the slice, the input keys' scores written on the way (KEEP_SCORES: with an evict-last hint,
    for a reader in the same launch). Returns the state and the rows' (row_ok, row_index)."""
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
    # Each range with its own strides (a (B,) range broadcast over R has stride 0); padding rows attend nothing:
    # start = kv_len = 0.
    start, input_end, kv_len = key_range(
        tl.load(start_ptr + b * stride_ib + r * stride_ir, mask=row_ok, other=0),
        tl.load(input_end_ptr + b * stride_eb + r * stride_er, mask=row_ok, other=0),
        tl.load(kv_len_ptr + b * stride_lb + r * stride_lr, mask=row_ok, other=0), keys)
    score_start = start
    if WINDOWED:  # a window's columns count from its inputs' start, at or before the attended start
        score_start = tl.minimum(
            tl.load(score_start_ptr + b * stride_fb + r * stride_fr, mask=row_ok, other=0).to(tl.int64), start)
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
    relative = scores_ptr.dtype.element_ty == tl.float16
    first = lo
    if relative:
        # Whole key blocks, so that the combine finds the block of key n at n // BLOCK_N.
        first = lo - lo % BLOCK_N
    row_index = (b * kv_heads * GROUP + head) * rows + r
    # Each row's bounds as int32 offsets from `first`, clamped into the slice's `span` keys: a mask of the (BLOCK_M,
    # BLOCK_N) tile is then one 32-bit compare per element and bound (an int64 compare takes two instructions), with
    # the slice's own bounds folded in. Attended keys: [attended_lo, attended_hi); inputs whose scores are stored:
    # [attended_lo, input_hi) (only an unchecked input range longer than the row of scores reaches column n_scores);
    # generated keys: from generated_lo.
    span = tl.maximum(hi - first, 0)
    attended_lo = _slice_offset(tl.maximum(start, lo), first, span)
    attended_hi = _slice_offset(tl.minimum(kv_len, hi), first, span)
    input_hi = tl.minimum(attended_hi, _slice_offset(tl.minimum(input_end, score_start + n_scores), first, span))
    generated_lo = _slice_offset(input_end, first, span)
    score_rows = scores_ptr + b * stride_sb + head * stride_sh + r * stride_sr + (first - score_start)
    for n0 in range(first, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        offset = (n0 - first).to(tl.int32) + tl.arange(0, BLOCK_N)
        # Keys past the slice load as 0, not as whatever an unused cache slot holds (0 * NaN would poison
        # the dot).
        in_slice = n < hi
        if relative:
            in_slice = in_slice & (n >= lo)
        kv_mask = in_slice[:, None] & d_mask[None, :]
        page, slot = _key_slots(n, in_slice, b, block_table_ptr, stride_tb, pages, PAGE_SIZE)
        k_rows = k_head + page * stride_kb + slot * stride_ks
        k = operand(tl.load(k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0), DOT_F32)
        attended = (offset[None, :] >= attended_lo[:, None]) & (offset[None, :] < attended_hi[:, None])
        s = dot(q, tl.trans(k), DOT_F32) * scale
        if SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
        s = tl.where(attended, s, float("-inf"))
        if WITH_SCORES:
            is_input = (offset[None, :] >= attended_lo[:, None]) & (offset[None, :] < input_hi[:, None])
            columns = score_rows[:, None] + offset[None, :]
            if not relative:
                if KEEP_SCORES:
                    tl.store(columns, s, mask=is_input, eviction_policy="evict_last")
                else:
                    tl.store(columns, s, mask=is_input)
        m_new = tl.maximum(m, tl.max(s, 1))
        correction = tl.exp(m - m_new)
        shifted = s - m_new[:, None]
        if WITH_SCORES and relative:
            # Each score as s - m_new in float16, the block's m_new in float32 beside it: m_new is at most lse, so
            # log p = s - lse keeps float16's relative precision (2^-11), in half the bytes.
            if KEEP_SCORES:
                tl.store(columns, shifted.to(tl.float16), mask=is_input, eviction_policy="evict_last")
                tl.store(tile_max_ptr + row_index * key_tiles + n0 // BLOCK_N, m_new, mask=row_ok,
                         eviction_policy="evict_last")
            else:
                tl.store(columns, shifted.to(tl.float16), mask=is_input)
                tl.store(tile_max_ptr + row_index * key_tiles + n0 // BLOCK_N, m_new, mask=row_ok)
        p = tl.exp(shifted)
        l = l * correction + tl.sum(p, 1)
        l_gen = l_gen * correction + tl.sum(tl.where(offset[None, :] >= generated_lo[:, None], p, 0.0), 1)
        if WITH_V:
            v_rows = v_head + page * stride_vb + slot * stride_vs
            v = operand(tl.load(v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0), DOT_F32)
            acc = acc * correction[:, None] + dot(p.to(v.dtype), v, DOT_F32)
        m = m_new
    return m, l, l_gen, acc, row_ok, row_index


@triton.jit
def _split_kv_kernel(
    q_ptr, k_ptr, v_ptr, start_ptr, input_end_ptr, kv_len_ptr, block_table_ptr, score_start_ptr,
    scores_ptr, tile_max_ptr, m_ptr, l_ptr, l_gen_ptr, acc_ptr,
    scale, softcap, split_size, splits, kv_heads, rows, key_tiles, keys, n_scores, pages,
    stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ib, stride_ir, stride_eb, stride_er, stride_lb, stride_lr, stride_fb, stride_fr,
    stride_tb, stride_sb, stride_sh, stride_sr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, WITH_V: tl.constexpr, WITH_SCORES: tl.constexpr, DOT_F32: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr,
):
    # Inductor passes Python floats as fp64 (a loop-carried max would turn fp64): the math stays fp32.
    scale, softcap = tl.cast(scale, tl.float32), tl.cast(softcap, tl.float32)
    m, l, l_gen, acc, row_ok, row_index = _split_slice(
        q_ptr, k_ptr, v_ptr, start_ptr, input_end_ptr, kv_len_ptr, block_table_ptr, score_start_ptr,
        scores_ptr, tile_max_ptr, scale, softcap, split_size, kv_heads, rows, key_tiles, keys, n_scores, pages,
        stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        stride_ib, stride_ir, stride_eb, stride_er, stride_lb, stride_lr, stride_fb, stride_fr,
    stride_tb, stride_sb, stride_sh, stride_sr,
        D, BLOCK_D, GROUP, BLOCK_M, BLOCK_N, WITH_V, WITH_SCORES, DOT_F32, PAGE_SIZE, SOFTCAP, WINDOWED, False)
    d = tl.arange(0, BLOCK_D)
    partial = row_index * splits + tl.program_id(1)
    tl.store(m_ptr + partial, m, mask=row_ok)
    tl.store(l_ptr + partial, l, mask=row_ok)
    tl.store(l_gen_ptr + partial, l_gen, mask=row_ok)
    if WITH_V:
        tl.store(acc_ptr + partial[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & (d < D)[None, :])


@triton.jit
def _key_tile(key, KEY_BLOCK: tl.constexpr, key_tiles):
    """The key block of `key`, whose max its relative score is taken from; an unchecked range's key outside the
    cache reads its nearest block's."""
    return tl.minimum(tl.maximum(key, 0) // KEY_BLOCK, key_tiles - 1)


@triton.jit
def _merge_split_chunks(m_ptr, l_ptr, l_gen_ptr, row_index, row_ok, splits, sink, HAS_SINKS: tl.constexpr,
                        ROWS: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLITS_CHUNK: tl.constexpr):
    """Merge ROWS rows' key slices, SPLITS_CHUNK slices at a time (an online merge; all (ROWS, SPLITS_PAD) at once
    spilled 0.7 KiB to 14 KiB a thread from 32 heads over 512 slices to 128 over 512): (lse, lse_gen, l, top), a slice
    weighing exp(m - top) / l in its row's output. Slices in which a row attends no key have l = 0; every row attends
    a key somewhere. Rows not row_ok get a finite lse, never used."""
    top = tl.full([ROWS], MIN_SCORE, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    l_gen = tl.zeros([ROWS], tl.float32)
    for first in range(0, SPLITS_PAD, SPLITS_CHUNK):  # a trip count ptxas knows; padding slices load nothing
        sp = first + tl.arange(0, SPLITS_CHUNK)
        at = row_index[:, None] * splits + sp[None, :]
        mask = row_ok[:, None] & (sp < splits)[None, :]
        m = tl.load(m_ptr + at, mask=mask, other=MIN_SCORE)
        new_top = tl.maximum(top, tl.max(m, 1))
        weight = tl.exp(m - new_top[:, None])
        rescale = tl.exp(top - new_top)
        l = l * rescale + tl.sum(weight * tl.load(l_ptr + at, mask=mask, other=0.0), 1)
        l_gen = l_gen * rescale + tl.sum(weight * tl.load(l_gen_ptr + at, mask=mask, other=0.0), 1)
        top = new_top
    l = tl.where(row_ok, l, 1.0)
    if HAS_SINKS:
        rescale = tl.exp(top - tl.maximum(top, sink))
        l = l * rescale + tl.exp(sink - tl.maximum(top, sink))
        l_gen = l_gen * rescale
        top = tl.maximum(top, sink)
    return top + tl.log(l), top + tl.log(l_gen), l, top


@triton.jit
def _combine_row(
    row, m_ptr, l_ptr, l_gen_ptr, acc_ptr, out_ptr, lse_ptr, lse_gen_ptr, sinks_ptr,
    splits, heads, rows, stride_ob, stride_oh, stride_or,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLITS_CHUNK: tl.constexpr,
    WITH_V: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Row `row` of (B, H, R): its lse, lse_gen and (WITH_V) out from the slices' partials, SPLITS_CHUNK slices'
    accumulators at a time (all of them at once spilled: 2.9 KiB a thread for 512 slices at D = 128, which one KV
    head's decode gets on an H200)."""
    one_row = row + tl.arange(0, 1)
    sink = tl.zeros([1], tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + one_row // rows % heads).to(tl.float32)
    lse, lse_gen, l, top = _merge_split_chunks(m_ptr, l_ptr, l_gen_ptr, one_row, one_row >= 0, splits, sink,
                                               HAS_SINKS, 1, SPLITS_PAD, SPLITS_PAD)
    tl.store(lse_ptr + one_row, lse)
    tl.store(lse_gen_ptr + one_row, lse_gen)
    if WITH_V:
        d = tl.arange(0, BLOCK_D)
        out = tl.zeros([BLOCK_D], tl.float32)
        for first in range(0, SPLITS_PAD, SPLITS_CHUNK):  # a trip count ptxas knows; padding slices load nothing
            chunk = first + tl.arange(0, SPLITS_CHUNK)
            chunk_mask = chunk < splits
            weight = tl.exp(tl.load(m_ptr + row * splits + chunk, mask=chunk_mask, other=MIN_SCORE) - top)
            acc = tl.load(acc_ptr + (row * splits + chunk)[:, None] * D + d[None, :],
                          mask=chunk_mask[:, None] & (d < D)[None, :], other=0.0)
            out += tl.sum(weight[:, None] * acc, 0)
        out = out / l
        target = out_ptr + row // (heads * rows) * stride_ob + row // rows % heads * stride_oh + row % rows * stride_or
        tl.store(target + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _split_kv_combine_kernel(
    m_ptr, l_ptr, l_gen_ptr, acc_ptr, out_ptr, lse_ptr, lse_gen_ptr, sinks_ptr,
    splits, heads, rows, stride_ob, stride_oh, stride_or,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLITS_CHUNK: tl.constexpr,
    WITH_V: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    _combine_row(tl.program_id(0).to(tl.int64), m_ptr, l_ptr, l_gen_ptr, acc_ptr, out_ptr, lse_ptr, lse_gen_ptr,
                 sinks_ptr, splits, heads, rows, stride_ob, stride_oh, stride_or, D, BLOCK_D, SPLITS_PAD,
                 SPLITS_CHUNK, WITH_V, HAS_SINKS)


@triton.jit
def _combine_pool_kernel(
    m_ptr, l_ptr, l_gen_ptr, acc_ptr, out_ptr, lse_ptr, lse_gen_ptr, sinks_ptr,
    scores_ptr, tile_max_ptr, given_lse_ptr, pool_start_ptr, input_end_ptr, start_ptr, kv_len_ptr, target_ptr,
    alpha, splits, heads, rows, n_target, pool_programs, tiles_per_program, key_tiles, keys,
    stride_ob, stride_oh, stride_or, stride_sb, stride_sh, stride_sr, stride_gb, stride_gh, stride_gr,
    stride_pb, stride_pr, stride_eb, stride_er, stride_ib, stride_ir, stride_lb, stride_lr, stride_tb, stride_tr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLITS_CHUNK: tl.constexpr,
    HEAD_SPLITS_CHUNK: tl.constexpr, H_PAD: tl.constexpr, BLOCK_I: tl.constexpr, KEY_BLOCK: tl.constexpr,
    WITH_V: tl.constexpr,
    HAS_SINKS: tl.constexpr, LSE_GIVEN: tl.constexpr, REDISTRIBUTE: tl.constexpr, POOLING: tl.constexpr,
    INTO_LOG_C: tl.constexpr, WINDOWED: tl.constexpr,
):
    """The combine and the head pooling in one launch: grid (B * R, pool_programs + H). Programs from
    pool_programs on are `_combine_row` for head program_id(1) - pool_programs; the others each merge the slices of
    all H heads of their query row again (H x splits partials, read from L2) and pool tiles_per_program tiles of
    BLOCK_I inputs, which `pool` would do in a third launch after the combine."""
    # Inductor passes Python floats as fp64 (a loop-carried max would turn fp64): the math stays fp32.
    alpha = tl.cast(alpha, tl.float32)
    b = (tl.program_id(0) // rows).to(tl.int64)
    r = (tl.program_id(0) % rows).to(tl.int64)
    program = tl.program_id(1)
    if program >= pool_programs:
        _combine_row((b * heads + program - pool_programs) * rows + r, m_ptr, l_ptr, l_gen_ptr, acc_ptr, out_ptr,
                     lse_ptr, lse_gen_ptr, sinks_ptr, splits, heads, rows, stride_ob, stride_oh, stride_or, D, BLOCK_D,
                     SPLITS_PAD, SPLITS_CHUNK, WITH_V, HAS_SINKS)
    else:
        h = tl.arange(0, H_PAD)
        h_mask = h < heads
        row_index = (b * heads + h) * rows + r
        sink = tl.zeros([H_PAD], tl.float32)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + h, mask=h_mask, other=0.0).to(tl.float32)
        lse, lse_gen, _, _ = _merge_split_chunks(m_ptr, l_ptr, l_gen_ptr, row_index, h_mask, splits, sink, HAS_SINKS,
                                                 H_PAD, SPLITS_PAD, HEAD_SPLITS_CHUNK)
        if LSE_GIVEN:
            lse = tl.load(given_lse_ptr + b * stride_gb + h * stride_gh + r * stride_gr, mask=h_mask, other=0.0)
            lse = lse.to(tl.float32)
        gen = tl.exp(lse_gen - lse)
        start, n_input = input_columns(start_ptr, input_end_ptr, kv_len_ptr, pool_start_ptr, b, r, keys, stride_ib,
                                       stride_ir, stride_eb, stride_er, stride_lb, stride_lr, stride_pb, stride_pr,
                                       WINDOWED)
        score_rows = scores_ptr + b * stride_sb + r * stride_sr + h[:, None] * stride_sh
        for t in range(0, tiles_per_program):
            i = (program * tiles_per_program + t) * BLOCK_I + tl.arange(0, BLOCK_I)
            # The scores hold n_target columns (an unchecked input range may be longer).
            tile_mask = h_mask[:, None] & ((i < n_input) & (i < n_target))[None, :]
            s = tl.load(score_rows + i[None, :], mask=tile_mask, other=float("-inf")).to(tl.float32)
            if scores_ptr.dtype.element_ty == tl.float16:  # relative to their key block's max
                s += tl.load(tile_max_ptr + row_index[:, None] * key_tiles + _key_tile(start + i, KEY_BLOCK,
                             key_tiles)[None, :], mask=tile_mask, other=0.0)
            pool_tile(tl.exp(s - lse[:, None]), gen, h_mask, i, n_input, heads, n_target,
                      target_ptr + b * stride_tb + r * stride_tr, alpha, REDISTRIBUTE, POOLING, INTO_LOG_C)


@triton.jit
def _one_launch_kernel(
    q_ptr, k_ptr, v_ptr, start_ptr, input_end_ptr, kv_len_ptr, block_table_ptr, score_start_ptr,
    scores_ptr, tile_max_ptr, m_ptr, l_ptr, l_gen_ptr, acc_ptr,
    out_ptr, lse_ptr, lse_gen_ptr, sinks_ptr, given_lse_ptr, pool_start_ptr, target_ptr, pooled_ptr, counter_ptr,
    scale, softcap, split_size, splits, kv_heads, rows, key_tiles, keys, n_scores, pages,
    stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ib, stride_ir, stride_eb, stride_er, stride_lb, stride_lr, stride_fb, stride_fr,
    stride_tb, stride_sb, stride_sh, stride_sr,
    alpha, n_target, stride_ob, stride_oh, stride_or, stride_gb, stride_gh, stride_gr, stride_cb, stride_cr,
    stride_pb, stride_pr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, WITH_V: tl.constexpr, WITH_SCORES: tl.constexpr, DOT_F32: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_I: tl.constexpr, HAS_SINKS: tl.constexpr, LSE_GIVEN: tl.constexpr,
    REDISTRIBUTE: tl.constexpr, POOLING: tl.constexpr, INTO_LOG_C: tl.constexpr,
):
    """The whole fused MACS pass in one launch, grid (B * H_kv * row tiles, splits) as `_split_kv_kernel`'s.

    Each program runs its (row tile, key slice) and stores its partials, then counts itself in at its tile's arrival
    counter (counter_ptr[pid], an int32 that the last arrival sets back to 0). The last of the tile's `splits`
    programs to arrive merges the slices' partials (its rows' lse, lse_gen and out), then pools its GQA group's
    probabilities of the input keys over the group's heads, from the scores the slices wrote moments before (in
    L2: stored evict-last, read once), into pooled_ptr (B, R, n_target) float32 by atomic max / min / add: a
    per-group partial of the max (min, sum) over all H heads. It then counts itself in at its item's counter
    (counter_ptr[grid size + b]); the last of the item's H_kv x row tiles arrivals applies the floor to log c (or
    writes m'), and sets pooled_ptr back to the pooling's identity (0, or +inf for min) for the next call."""
    # Inductor passes Python floats as fp64 (a loop-carried max would turn fp64): the math stays fp32.
    scale, softcap, alpha = tl.cast(scale, tl.float32), tl.cast(softcap, tl.float32), tl.cast(alpha, tl.float32)
    m, l, l_gen, acc, row_ok, row_index = _split_slice(
        q_ptr, k_ptr, v_ptr, start_ptr, input_end_ptr, kv_len_ptr, block_table_ptr, score_start_ptr,
        scores_ptr, tile_max_ptr, scale, softcap, split_size, kv_heads, rows, key_tiles, keys, n_scores, pages,
        stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        stride_ib, stride_ir, stride_eb, stride_er, stride_lb, stride_lr, stride_fb, stride_fr,
    stride_tb, stride_sb, stride_sh, stride_sr,
        D, BLOCK_D, GROUP, BLOCK_M, BLOCK_N, WITH_V, WITH_SCORES, DOT_F32, PAGE_SIZE, SOFTCAP, WINDOWED, True)
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    partial = row_index * splits + tl.program_id(1)
    tl.store(m_ptr + partial, m, mask=row_ok)
    tl.store(l_ptr + partial, l, mask=row_ok)
    tl.store(l_gen_ptr + partial, l_gen, mask=row_ok)
    if WITH_V:
        tl.store(acc_ptr + partial[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_mask[None, :])
    # Every thread's stores before one thread's release (as CUTLASS's semaphore: a CTA barrier, then the release).
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
    if arrived == splits - 1:
        tl.atomic_xchg(counter_ptr + pid, 0, sem="relaxed", scope="gpu")
        row_tiles = tl.cdiv(GROUP * rows, BLOCK_M)
        tile = pid % row_tiles
        b = (pid // row_tiles // kv_heads).to(tl.int64)
        kv_head = (pid // row_tiles % kv_heads).to(tl.int64)
        m_index = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        head = kv_head * GROUP + m_index % GROUP
        r = m_index // GROUP
        heads = kv_heads * GROUP

        # The combine of this tile's rows: an online merge over the slices (L2 reads: .cg, another SM wrote them).
        top = tl.full([BLOCK_M], MIN_SCORE, tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        l_gen = tl.zeros([BLOCK_M], tl.float32)
        out = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for sp in range(0, splits):
            at = row_index * splits + sp
            m_sp = tl.load(m_ptr + at, mask=row_ok, other=MIN_SCORE, cache_modifier=".cg")
            new_top = tl.maximum(top, m_sp)
            old = tl.exp(top - new_top)
            weight = tl.exp(m_sp - new_top)
            l = l * old + weight * tl.load(l_ptr + at, mask=row_ok, other=0.0, cache_modifier=".cg")
            l_gen = l_gen * old + weight * tl.load(l_gen_ptr + at, mask=row_ok, other=0.0, cache_modifier=".cg")
            if WITH_V:
                part = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=row_ok[:, None] & d_mask[None, :],
                               other=0.0, cache_modifier=".cg")
                out = out * old[:, None] + weight[:, None] * part
            top = new_top
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            rescale = tl.exp(top - tl.maximum(top, sink))
            out = out * rescale[:, None]
            l = l * rescale + tl.exp(sink - tl.maximum(top, sink))
            l_gen = l_gen * rescale
            top = tl.maximum(top, sink)
        lse = top + tl.log(l)
        lse_gen = top + tl.log(l_gen)
        tl.store(lse_ptr + row_index, lse, mask=row_ok)
        tl.store(lse_gen_ptr + row_index, lse_gen, mask=row_ok)
        if WITH_V:
            target = out_ptr + b * stride_ob + head * stride_oh + r * stride_or
            tl.store(target[:, None] + d[None, :], (out / l[:, None]).to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_mask[None, :])

        # This group's share of the pooling, query row by query row of the tile.
        relative = scores_ptr.dtype.element_ty == tl.float16
        g = tl.arange(0, GROUP_PAD)
        first_row = tile * BLOCK_M // GROUP
        last_row = tl.minimum(rows, (tile * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
        for rr in range(first_row, last_row):
            mm = rr * GROUP + g
            ok = (g < GROUP) & (mm >= tile * BLOCK_M) & (mm < tile * BLOCK_M + BLOCK_M)
            pick = mm[:, None] == m_index[None, :]
            head_g = kv_head * GROUP + g
            # The group's lse and lse_gen of query row rr, picked out of the tile's rows.
            lse_g = tl.max(tl.where(pick, lse[None, :], float("-inf")), 1)
            lse_gen_g = tl.max(tl.where(pick, lse_gen[None, :], float("-inf")), 1)
            if LSE_GIVEN:
                lse_g = tl.load(given_lse_ptr + b * stride_gb + head_g * stride_gh + rr * stride_gr, mask=ok,
                                other=0.0).to(tl.float32)
            gen = tl.exp(lse_gen_g - lse_g)
            pool_start, n_input = input_columns(start_ptr, input_end_ptr, kv_len_ptr, pool_start_ptr, b, rr, keys,
                                                stride_ib, stride_ir, stride_eb, stride_er, stride_lb, stride_lr,
                                                stride_pb, stride_pr, WINDOWED)
            spread = gen / n_input.to(tl.float32)
            score_rows = scores_ptr + b * stride_sb + rr * stride_sr + head_g[:, None] * stride_sh
            max_rows = tile_max_ptr + ((b * heads + head_g) * rows + rr) * key_tiles
            pooled_row = pooled_ptr + (b * rows + rr) * n_target
            # The scores and the pooled row hold n_target columns (an unchecked input range may be longer).
            n_columns = tl.minimum(n_input, n_target)
            for i0 in range(0, n_columns, BLOCK_I):
                i = i0 + tl.arange(0, BLOCK_I)
                i_mask = i < n_columns
                tile_mask = ok[:, None] & i_mask[None, :]
                s = tl.load(score_rows + i[None, :], mask=tile_mask, other=float("-inf"),
                            cache_modifier=".cg").to(tl.float32)
                if relative:  # relative to their key block's max
                    s += tl.load(max_rows[:, None] + _key_tile(pool_start + i, BLOCK_N, key_tiles)[None, :],
                                 mask=tile_mask, other=0.0, cache_modifier=".cg")
                x = tl.exp(s - lse_g[:, None])
                if REDISTRIBUTE:
                    x += spread[:, None]
                if POOLING == "max":
                    tl.atomic_max(pooled_row + i, tl.max(tl.where(ok[:, None], x, float("-inf")), 0), mask=i_mask,
                                  sem="relaxed", scope="gpu")
                elif POOLING == "min":
                    tl.atomic_min(pooled_row + i, tl.min(tl.where(ok[:, None], x, float("inf")), 0), mask=i_mask,
                                  sem="relaxed", scope="gpu")
                else:
                    tl.atomic_add(pooled_row + i, tl.sum(tl.where(ok[:, None], x, 0.0), 0), mask=i_mask,
                                  sem="relaxed", scope="gpu")

        # The item's last group applies the floor (or writes m') and leaves the pooled rows at the identity.
        tl.debug_barrier()
        item_slot = counter_ptr + tl.num_programs(0) + b
        done = tl.atomic_add(item_slot, 1, sem="acq_rel", scope="gpu")
        if done == kv_heads * row_tiles - 1:
            tl.atomic_xchg(item_slot, 0, sem="relaxed", scope="gpu")
            identity = 0.0
            if POOLING == "min":
                identity = float("inf")
            for rr in range(0, rows):
                _, n_input = input_columns(start_ptr, input_end_ptr, kv_len_ptr, pool_start_ptr, b, rr, keys,
                                           stride_ib, stride_ir, stride_eb, stride_er, stride_lb, stride_lr,
                                           stride_pb, stride_pr, WINDOWED)
                pooled_row = pooled_ptr + (b * rows + rr) * n_target
                target_row = target_ptr + b * stride_cb + rr * stride_cr
                for i0 in range(0, n_target, BLOCK_I):
                    i = i0 + tl.arange(0, BLOCK_I)
                    i_mask = (i < n_input) & (i < n_target)
                    pooled = tl.load(pooled_row + i, mask=i_mask, other=0.0, cache_modifier=".cg")
                    tl.store(pooled_row + i, tl.full([BLOCK_I], identity, tl.float32), mask=i_mask)
                    if POOLING == "mean":
                        pooled = pooled / heads
                    if INTO_LOG_C:
                        # Efficient-attention rows can pool below zero; clamping keeps the floor's log defined.
                        term = tl.log(alpha * tl.maximum(pooled, 0.0) + (1.0 - alpha))
                        tl.store(target_row + i, tl.load(target_row + i, mask=i_mask) + term, mask=i_mask)
                    else:
                        tl.store(target_row + i, tl.where(i_mask, pooled, 0.0), mask=i < n_target)


def split_kv_pass(q, k_cache, v_cache, start, input_end, kv_len, scale, n_scores, block_table=None, *,
                  score_start=None, softcap=None, sinks=None):
    """q (B, H, R, D) (any strides, unit last); ranges (B, R) int32 or int64, each read with its own strides (stride 0
    over R: a (B,) range broadcast).
    score_start (B, R), same strides: where a row's score columns start when it differs from its attended start
    (a window; columns before the window stay -inf); softcap, sinks (H,): the layer's variant.
    v_cache None skips out; n_scores > 0 also returns the input keys' scores. With a block_table (B, pages)
    int32 the caches are paged, (P, page_size, H_kv, D), and key j of item b is in page
    block_table[b, j // page_size]; otherwise they are (B, H_kv, S, D).

    Returns (out (B, H, R, D) in q's dtype or None, lse (B, H, R) float32, lse_gen (B, H, R) float32 (-inf
    where no generated key), scores (B, H, R, n_scores) float32 or None).
    """
    split = _split(q, k_cache, v_cache, start, input_end, kv_len, scale, n_scores, block_table, score_start, softcap,
                   relative_scores=False)
    out, lse, lse_gen = _outputs(q, split)
    target = out if split.with_v else lse
    launch(
        _split_kv_combine_kernel, (q.shape[0] * q.shape[1] * q.shape[2],),
        split.m, split.l, split.l_gen, split.acc, target, lse, lse_gen, split.m if sinks is None else sinks,
        split.tiles.splits, q.shape[1], q.shape[2], *(target.stride(i) if split.with_v else 0 for i in range(3)),
        D=q.shape[3], BLOCK_D=head_block(q.shape[3]), SPLITS_PAD=next_pow2(split.tiles.splits),
        SPLITS_CHUNK=splits_chunk(split.tiles.splits, head_block(q.shape[3])), WITH_V=split.with_v,
        HAS_SINKS=sinks is not None,
        num_warps=4,
    )
    return out, lse, lse_gen, split.scores if n_scores else None


def fused_pass(q, k_cache, v_cache, start, input_end, kv_len, scale, target, *, pool_start, lse=None, alpha=None,
               pooling, redistribute, into_log_c, block_table=None, score_start=None, softcap=None, sinks=None):
    """The split-KV pass and the head pooling of its input keys' probabilities into target (pool's
    log_c or out), by the pass that settings.triton_split_kv_pass() names: "verified" launches split_kv_pass
    and pool; "two-launch" the split kernel and `_combine_pool_kernel`. Arguments as split_kv_pass's and pool's
    (pool_start, input_end: the pooled input range; lse (B, H, R) given replaces the computed one in the
    probabilities; alpha: log c's floor weight, into_log_c only). Returns (out or None, lse (B, H, R) computed)."""
    pooled = dict(alpha=alpha, pooling=pooling, redistribute=redistribute, into_log_c=into_log_c)
    if triton_split_kv_pass() == "verified":
        out, own_lse, lse_gen, scores = split_kv_pass(
            q, k_cache, v_cache, start, input_end, kv_len, scale, target.shape[-1], block_table,
            score_start=score_start, softcap=softcap, sinks=sinks)
        pool(scores, target, start, input_end, kv_len, _cache_keys(k_cache, block_table),
             column_start=None if score_start is None else pool_start, lse=own_lse if lse is None else lse,
             generated=lse_gen, **pooled)
        return out, own_lse
    if triton_split_kv_pass() == "one-launch":
        return _one_launch(q, k_cache, v_cache, start, input_end, kv_len, scale, target, pool_start=pool_start,
                           lse=lse, block_table=block_table, score_start=score_start, softcap=softcap, sinks=sinks,
                           **pooled)
    batch, heads, rows, dim = q.shape
    n_target = target.shape[-1]
    # log c of half-precision inputs is held to their dtype's tolerance (2e-3 for float16), which float16 relative
    # scores keep (log p within 2^-11 of itself, see _split_kv_kernel); m' written out is held to float32's.
    relative = into_log_c and k_cache.dtype in (torch.float16, torch.bfloat16)
    split = _split(q, k_cache, v_cache, start, input_end, kv_len, scale, n_target, block_table, score_start, softcap,
                   relative_scores=relative)
    out, own_lse, lse_gen = _outputs(q, split)
    given = own_lse if lse is None else lse
    target3 = target.view(batch, rows, n_target)
    block_i = pool_block(heads, n_target)
    tiles = cdiv(n_target, block_i)
    per_program = cdiv(tiles, min(tiles, max(1, cdiv(2 * multiprocessors(q.device), batch * rows))))
    pool_programs = cdiv(tiles, per_program)
    scores = split.scores
    launch(
        _combine_pool_kernel, (batch * rows, pool_programs + heads),
        split.m, split.l, split.l_gen, split.acc, out if split.with_v else own_lse, own_lse, lse_gen,
        split.m if sinks is None else sinks, scores, split.tile_max, given, pool_start, input_end, start, kv_len,
        target3, float(alpha) if into_log_c else 0.0, split.tiles.splits, heads, rows, n_target, pool_programs,
        per_program, split.key_tiles, _cache_keys(k_cache, block_table),
        *(out.stride(i) if split.with_v else 0 for i in range(3)), scores.stride(0), scores.stride(1),
        scores.stride(2), given.stride(0), given.stride(1), given.stride(2), *pool_start.stride(), *input_end.stride(),
        *start.stride(), *kv_len.stride(), target3.stride(0), target3.stride(1),
        D=dim, BLOCK_D=head_block(dim), SPLITS_PAD=next_pow2(split.tiles.splits),
        SPLITS_CHUNK=splits_chunk(split.tiles.splits, head_block(dim)),
        HEAD_SPLITS_CHUNK=splits_chunk(split.tiles.splits, 2 * next_pow2(heads)), H_PAD=next_pow2(heads),
        BLOCK_I=block_i, KEY_BLOCK=split.tiles.block_n, WITH_V=split.with_v, HAS_SINKS=sinks is not None,
        LSE_GIVEN=lse is not None, REDISTRIBUTE=redistribute, POOLING=pooling, INTO_LOG_C=into_log_c,
        WINDOWED=score_start is not None, num_warps=4,
    )
    return out, own_lse


def _one_launch(q, k_cache, v_cache, start, input_end, kv_len, scale, target, *, pool_start, lse, alpha, pooling,
                redistribute, into_log_c, block_table, score_start, softcap, sinks):
    """fused_pass by `_one_launch_kernel`: one launch, float16 relative scores for the log c update of half-precision
    inputs (as the two-launch pass), pooled in the same launch from L2."""
    batch, heads, rows, dim = q.shape
    n_target = target.shape[-1]
    relative = into_log_c and k_cache.dtype in (torch.float16, torch.bfloat16)
    split, grid, args, constexprs = _split_plan(q, k_cache, v_cache, start, input_end, kv_len, scale, n_target,
                                                block_table, score_start, softcap, relative_scores=relative,
                                                max_rows=ONE_LAUNCH_ROWS)
    out, own_lse, lse_gen = _outputs(q, split)
    given = own_lse if lse is None else lse
    target3 = target.view(batch, rows, n_target)
    counters, pooled = _workspace(q.device, grid[0] + batch, batch * rows * n_target,
                                  float("inf") if pooling == "min" else 0.0)
    launch(
        _one_launch_kernel, grid,
        *args[:10], split.m, split.l, split.l_gen, split.acc,
        out if split.with_v else own_lse, own_lse, lse_gen, split.m if sinks is None else sinks, given, pool_start,
        target3, pooled, counters, *args[10:],
        float(alpha) if into_log_c else 0.0, n_target, *(out.stride(i) if split.with_v else 0 for i in range(3)),
        given.stride(0), given.stride(1), given.stride(2), target3.stride(0), target3.stride(1), *pool_start.stride(),
        **constexprs, GROUP_PAD=next_pow2(constexprs["GROUP"]),
        BLOCK_I=pool_block(constexprs["GROUP"], n_target), HAS_SINKS=sinks is not None, LSE_GIVEN=lse is not None,
        REDISTRIBUTE=redistribute, POOLING=pooling, INTO_LOG_C=into_log_c, num_warps=split.tiles.num_warps,
        num_stages=3,
    )
    return out, own_lse


# (device, stream, identity) -> (int32 arrival counters, float32 pooled rows), both left as found by every launch of
# `_one_launch_kernel` (counters at 0, pooled rows at the pooling's identity); grown, never shrunk. One per stream:
# two launches in flight on different streams must not share them.
_WORKSPACES: dict = {}


def _workspace(device: torch.device, counters: int, pooled: int, identity: float):
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (device, stream, identity)
    held = _WORKSPACES.get(key)
    if held is None or held[0].numel() < counters or held[1].numel() < pooled:
        size = max(next_pow2(counters), 0 if held is None else held[0].numel())
        width = max(next_pow2(pooled), 0 if held is None else held[1].numel())
        held = (torch.zeros(size, device=device, dtype=torch.int32),
                torch.full((width,), identity, device=device, dtype=torch.float32))
        _WORKSPACES[key] = held
    return held


@dataclasses.dataclass(frozen=True)
class _Split:
    """What the split kernel left for the combine: per (row, slice) partials and the input keys' scores (float16
    relative to tile_max (B, H, R, key_tiles), the max of each row's key block, or float32)."""
    tiles: SplitKV
    with_v: bool
    m: torch.Tensor
    l: torch.Tensor
    l_gen: torch.Tensor
    acc: torch.Tensor
    scores: torch.Tensor
    tile_max: torch.Tensor
    key_tiles: int


def _outputs(q, split: _Split):
    """Empty out (B, H, R, D) in q's dtype (None without V), lse and lse_gen (B, H, R) float32."""
    batch, heads, rows, dim = q.shape
    out = torch.empty(batch, heads, rows, dim, device=q.device, dtype=q.dtype) if split.with_v else None
    lse, lse_gen = (torch.empty(batch, heads, rows, device=q.device, dtype=torch.float32) for _ in range(2))
    return out, lse, lse_gen


def _split(q, k_cache, v_cache, start, input_end, kv_len, scale, n_scores, block_table, score_start, softcap, *,
           relative_scores):
    """Launch `_split_kv_kernel` (arguments as split_kv_pass's; relative_scores: float16 scores, see _Split)."""
    split, grid, args, constexprs = _split_plan(q, k_cache, v_cache, start, input_end, kv_len, scale, n_scores,
                                                block_table, score_start, softcap, relative_scores=relative_scores)
    launch(_split_kv_kernel, grid, *args[:10], split.m, split.l, split.l_gen, split.acc, *args[10:], **constexprs,
           num_warps=split.tiles.num_warps, num_stages=3)
    return split


def _cache_keys(k_cache, block_table) -> int:
    """Keys per item: a contiguous cache's S, or the pages a table row names times their size."""
    return k_cache.shape[2] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def _split_plan(q, k_cache, v_cache, start, input_end, kv_len, scale, n_scores, block_table, score_start, softcap, *,
                relative_scores, max_rows=64):
    """The buffers (a _Split), grid, arguments and constexprs of the split kernel (tiles of at most max_rows rows):
    `args` are `_split_kv_kernel`'s without its four partial pointers (m_ptr .. acc_ptr, which follow args[:10])."""
    batch, heads, rows, dim = q.shape
    paged = block_table is not None
    keys = _cache_keys(k_cache, block_table)
    if paged:
        page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        # (item or page, head, slot) strides, the order the kernel takes for either layout.
        k_strides, v_strides = ((t.stride(0), t.stride(2), t.stride(1)) if t is not None else None
                                for t in (k_cache, v_cache))
    else:
        page_size, kv_heads = 0, k_cache.shape[1]
        k_strides, v_strides = (t.stride()[:3] if t is not None else None for t in (k_cache, v_cache))
    group = heads // kv_heads
    with_v = v_cache is not None
    dot_f32 = dot_in_f32(q, k_cache, *((v_cache,) if with_v else ()))
    tiles = split_kv_tiles(batch, kv_heads, group * rows, keys, dim, dot_f32, q.device, max_rows)
    f32 = dict(device=q.device, dtype=torch.float32)
    m, l, l_gen = (torch.empty(batch, heads, rows, tiles.splits, **f32) for _ in range(3))
    acc = torch.empty(batch, heads, rows, tiles.splits, dim, **f32) if with_v else m
    windowed = score_start is not None
    relative = relative_scores and bool(n_scores)
    key_tiles = cdiv(keys, tiles.block_n) if relative else 0
    if n_scores:
        kind = dict(f32, dtype=torch.float16 if relative else torch.float32)
        scores = (torch.full if windowed else torch.empty)(
            (batch, heads, rows, max(n_scores, 1)), *((float("-inf"),) if windowed else ()), **kind)
    else:
        scores = m
    # A window's columns before its first attended key stay -inf: the max of their block must be finite.
    tile_max = (torch.zeros if windowed else torch.empty)(batch, heads, rows, key_tiles, **f32) if relative else m
    v = v_cache if with_v else k_cache
    grid = (batch * kv_heads * cdiv(group * rows, tiles.block_m), tiles.splits)
    args = (
        q, k_cache, v, start, input_end, kv_len, block_table if paged else start,
        score_start if windowed else start, scores, tile_max,
        scale, 1.0 if softcap is None else float(softcap), tiles.split_size, tiles.splits, kv_heads, rows, key_tiles,
        keys, scores.shape[3] if n_scores else 0, k_cache.shape[0] if paged else 0,
        q.stride(0), q.stride(1), q.stride(2), *k_strides, *(v_strides if with_v else k_strides),
        *start.stride(), *input_end.stride(), *kv_len.stride(), *(score_start if windowed else start).stride(),
        block_table.stride(0) if paged else 0,
        scores.stride(0), scores.stride(1), scores.stride(2),
    )
    constexprs = dict(
        D=dim, BLOCK_D=head_block(dim), GROUP=group, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        WITH_V=with_v, WITH_SCORES=bool(n_scores), DOT_F32=dot_f32, PAGE_SIZE=page_size,
        SOFTCAP=softcap is not None, WINDOWED=windowed,
    )
    return _Split(tiles, with_v, m, l, l_gen, acc, scores, tile_max, key_tiles), grid, args, constexprs

"""The split-KV pass: flash-decoding of query rows whose key ranges differ per row, shared by
decode_attention, macs_update and macs_pool.

`_split_kv_kernel` (grid (B * H_kv * row tiles, splits)): one program owns BLOCK_M rows of one KV head
(query heads of the GQA group x query rows: row m is head m % G of query m // G, padded to 16 rows for
tl.dot) and one slice of the keys, so each K/V tile is loaded once for all of them. Row (b, h, r) attends
keys [start, kv_len) of its own range; per row it keeps an online softmax (max m, mass l) and, in the same
registers, the mass l_gen of its generated keys [input_end, kv_len): exp(lse_gen - lse) is then the row's
attention on generated tokens without a second pass over K. With scores on, it writes the scores of the
input keys (and of the keys beside them that their key blocks reach) into rows of (B, H, R, score_columns(N_max))
float32, key start + i in column i + start % 16: H x R x N x 4 bytes, against H_kv x S x 2D bytes of K.
`_split_kv_combine_kernel` (grid (B * H * R,)): merges the slices into lse, lse_gen and out.

The fused MACS pass (`fused_pass`) then pools the input keys' probabilities over heads (pool.py's `_pool_kernel`):
three launches. Two passes with fewer launches (the pooling folded into the combine, with float16 relative scores;
everything in the split launch after each tile's last arrival) were slower on an H200 at every shape of issue 48's
table (1.08-1.19x and 2.0-11.0x this pass's time, benchmarks/results/ops_issue48_h200_0d14256.csv) and are gone.

Attention variants (ops.Variant): a sliding window is a row whose attended start lies after its input start
(its score columns count from the input start, `score_start`, which may precede the cache's first slot: the
inputs that slid out); SOFTCAP caps the scores to softcap * tanh(s / softcap) before anything else reads them;
HAS_SINKS adds each head's sink logit to the denominator in the combine (the sink attends no value).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from macs_kernels.ops.triton.common import (
    MIN_SCORE,
    cdiv,
    clamped,
    dependent_launch,
    dependent_options,
    dot,
    dot_in_f32,
    fast_exp,
    head_block,
    key_range,
    launch,
    next_pow2,
    operand,
    release_dependent_grid,
    score_base,
    split_kv_tiles,
    splits_chunk,
    wait_for_prior_grid,
)
from macs_kernels.ops.triton.pool import pool


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
def _split_kv_kernel(
    q_ptr, k_ptr, v_ptr, start_ptr, input_end_ptr, kv_len_ptr, block_table_ptr, score_start_ptr,
    scores_ptr, partials_ptr,
    scale, softcap, split_size, splits, kv_heads, rows, keys, n_columns, pages, stride_part,
    stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ib, stride_ir, stride_eb, stride_er, stride_lb, stride_lr, stride_fb, stride_fr,
    stride_tb, stride_sb, stride_sh, stride_sr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, D_V: tl.constexpr, BLOCK_DV: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WITH_V: tl.constexpr, WITH_SCORES: tl.constexpr,
    DOT_F32: tl.constexpr, PAGE_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOWED: tl.constexpr, PDL: tl.constexpr,
):
    """One program's (row tile, key slice): the online softmax state (m, l, l_gen, acc) of its BLOCK_M rows over the
    slice, stored as the slice's partials for the combine, and the input keys' scores written on the way. D: q's and
    K's head dimension, D_V: V's (they differ in models such as DeepSeek-V2's). PDL: the combine launches as its
    programmatic dependent."""
    release_dependent_grid(PDL)
    # Inductor passes Python floats as fp64 (a loop-carried max would turn fp64): the math stays fp32.
    scale, softcap = tl.cast(scale, tl.float32), tl.cast(softcap, tl.float32)
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
    # On tensor cores, from a whole key block (a slice is whole blocks): with the scores' columns aligned below, every
    # key block stores as 16-byte vectors. Keys before a row's start are masked as ever. float32's CUDA-core tiles start
    # at the first row's start (aligned, they spilled 8 bytes a thread on sm_80).
    first_key = tl.min(tl.where(row_ok, start, 2147483647), 0)
    if not DOT_F32:
        first_key = first_key.to(tl.int32) // BLOCK_N * BLOCK_N
    lo = tl.maximum(first_key, split * split_size)
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
    dv = tl.arange(0, BLOCK_DV)
    dv_mask = dv < D_V
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # Where the rows' partials go, computed before the loop: only it stays live through it, not head and r (float32
    # at D 128 on sm_80 spilled 8 bytes a thread with those).
    partial = ((b * kv_heads * GROUP + head) * rows + r) * splits + split
    # Each row's bounds as int32 offsets from `lo`, clamped into the slice's `span` keys: a mask of the (BLOCK_M,
    # BLOCK_N) tile is then one 32-bit compare per element and bound (an int64 compare takes two instructions), with
    # the slice's own bounds folded in. Attended keys: [attended_lo, attended_hi); generated keys: from generated_lo;
    # inputs whose scores float32's pass stores: [attended_lo, input_hi) (within the row's columns).
    span = tl.maximum(hi - lo, 0)
    attended_lo = _slice_offset(tl.maximum(start, lo), lo, span)
    attended_hi = _slice_offset(tl.minimum(kv_len, hi), lo, span)
    generated_lo = _slice_offset(input_end, lo, span)
    input_hi = tl.minimum(attended_hi, _slice_offset(tl.minimum(input_end, score_start + n_columns - 15), lo, span))
    # A key block's columns start on a 64-byte boundary (common.score_base) and, with a mask whole over every 16
    # columns, store as 16-byte vectors (a mask of the row's inputs alone stored them a float at a time). So every
    # column of the row's n_columns (a multiple of 16) that a block reaches is stored; the pool reads the inputs'.
    row_base = score_base(score_start)
    # A padding row's columns lie far past any key (arithmetic, not a select, which would hide the 16s from Triton).
    column_lo = (row_base - lo + (1 - row_ok.to(tl.int64)) * (1 << 30)).to(tl.int32)
    column_hi = column_lo + n_columns
    score_rows = scores_ptr + b * stride_sb + head * stride_sh + r * stride_sr + (lo - row_base)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        offset = (n0 - lo).to(tl.int32) + tl.arange(0, BLOCK_N)
        # Keys past the slice load as 0, not as whatever an unused cache slot holds (0 * NaN would poison
        # the dot).
        in_slice = n < hi
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
            if DOT_F32:  # its blocks start at the first row's start, and the last may reach into the next slice
                stored = (offset[None, :] >= attended_lo[:, None]) & (offset[None, :] < input_hi[:, None])
            else:
                stored = (offset[None, :] >= column_lo[:, None]) & (offset[None, :] < column_hi[:, None])
            tl.store(score_rows[:, None] + offset[None, :], s, mask=stored)
        m_new = tl.maximum(m, tl.max(s, 1))
        # The rescale stays tl.exp: with its two calls on fast_exp too, ptxas spilled 8 bytes a thread at two tiles'
        # register caps (D 64 paged on sm_80, D 256 on sm_90).
        correction = tl.exp(m - m_new)
        p = fast_exp(s - m_new[:, None])
        l = l * correction + tl.sum(p, 1)
        l_gen = l_gen * correction + tl.sum(tl.where(offset[None, :] >= generated_lo[:, None], p, 0.0), 1)
        if WITH_V:
            v_rows = v_head + page * stride_vb + slot * stride_vs
            v = operand(tl.load(v_rows[:, None] + dv[None, :], mask=in_slice[:, None] & dv_mask[None, :], other=0.0),
                        DOT_F32)
            acc = acc * correction[:, None] + dot(p.to(v.dtype), v, DOT_F32)
        m = m_new
    tl.store(partials_ptr + partial, m, mask=row_ok)
    tl.store(partials_ptr + stride_part + partial, l, mask=row_ok)
    tl.store(partials_ptr + 2 * stride_part + partial, l_gen, mask=row_ok)
    if WITH_V:
        tl.store(partials_ptr + 3 * stride_part + partial[:, None] * D_V + dv[None, :], acc,
                 mask=row_ok[:, None] & dv_mask[None, :])


@triton.jit
def _chunk_partials(partials_ptr, stats, row, splits, stride_part, first, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    SPLITS_CHUNK: tl.constexpr):
    """Slices [first, first + SPLITS_CHUNK)'s maxima and accumulators of row `row` (padding slices: MIN_SCORE, 0)."""
    chunk = first + tl.arange(0, SPLITS_CHUNK)
    chunk_mask = chunk < splits
    d = tl.arange(0, BLOCK_D)
    m = tl.load(stats + chunk, mask=chunk_mask, other=MIN_SCORE)
    acc = tl.load(partials_ptr + 3 * stride_part + (row * splits + chunk)[:, None] * D + d[None, :],
                  mask=chunk_mask[:, None] & (d < D)[None, :], other=0.0)
    return m, acc


@triton.jit
def _combine_row(
    row, partials_ptr, out_ptr, lse_ptr, lse_gen_ptr, sinks_ptr,
    splits, heads, rows, stride_part, stride_ob, stride_oh, stride_or,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLITS_CHUNK: tl.constexpr,
    WITH_V: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Row `row` of (B, H, R): its lse, lse_gen and (WITH_V) out from the slices' partials (m, l, l_gen and acc, each
    in its region of the workspace, `stride_part` apart), a slice weighing
    exp(m - top) / l. Slices in which the row attends no key have l = 0; every row attends a key somewhere. The
    accumulators are summed SPLITS_CHUNK slices at a time (all of them at once spilled: 2.9 KiB a thread for 512
    slices at D = 128, which one KV head's decode gets on an H200)."""
    sp = tl.arange(0, SPLITS_PAD)
    sp_mask = sp < splits
    stats = partials_ptr + row * splits
    # The statistics, the sink and the first chunk of accumulators load before the first block-wide max: the split
    # kernel wrote them (each load an L2 round trip), and a load after a reduction's barrier waits for it.
    m = tl.load(stats + sp, mask=sp_mask, other=MIN_SCORE)
    l = tl.load(stats + stride_part + sp, mask=sp_mask, other=0.0)
    l_gen = tl.load(stats + 2 * stride_part + sp, mask=sp_mask, other=0.0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + row // rows % heads).to(tl.float32)
    if WITH_V:
        chunk_m, chunk_acc = _chunk_partials(partials_ptr, stats, row, splits, stride_part, 0, D, BLOCK_D,
                                             SPLITS_CHUNK)
    top = tl.max(m, 0)
    weight = fast_exp(m - top)
    l = tl.sum(weight * l, 0)
    l_gen = tl.sum(weight * l_gen, 0)
    if HAS_SINKS:
        rescale = fast_exp(top - tl.maximum(top, sink))
        l = l * rescale + fast_exp(sink - tl.maximum(top, sink))
        l_gen = l_gen * rescale
        top = tl.maximum(top, sink)
    if WITH_V:
        d = tl.arange(0, BLOCK_D)
        out = tl.sum(fast_exp(chunk_m - top)[:, None] * chunk_acc, 0)
        for first in range(SPLITS_CHUNK, SPLITS_PAD, SPLITS_CHUNK):  # a loop, not unrolled: 16 chunks at D 256
            chunk_m, chunk_acc = _chunk_partials(partials_ptr, stats, row, splits, stride_part, first, D, BLOCK_D,
                                                 SPLITS_CHUNK)
            out += tl.sum(fast_exp(chunk_m - top)[:, None] * chunk_acc, 0)
        out = out / l
        target = out_ptr + row // (heads * rows) * stride_ob + row // rows % heads * stride_oh + row % rows * stride_or
        tl.store(target + d, out.to(out_ptr.dtype.element_ty), mask=d < D)
    tl.store(lse_ptr + row, top + tl.log(l))
    tl.store(lse_gen_ptr + row, top + tl.log(l_gen))


@triton.jit
def _split_kv_combine_kernel(
    partials_ptr, out_ptr, lse_ptr, lse_gen_ptr, sinks_ptr,
    splits, heads, rows, stride_part, stride_ob, stride_oh, stride_or,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLITS_CHUNK: tl.constexpr,
    WITH_V: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    """PDL: launched as the split kernel's programmatic dependent, and the head pooling as its own."""
    wait_for_prior_grid(PDL)
    release_dependent_grid(PDL)
    _combine_row(tl.program_id(0).to(tl.int64), partials_ptr, out_ptr, lse_ptr, lse_gen_ptr, sinks_ptr, splits,
                 heads, rows, stride_part, stride_ob, stride_oh, stride_or, D, BLOCK_D, SPLITS_PAD, SPLITS_CHUNK,
                 WITH_V, HAS_SINKS)


def split_kv_pass(q, k_cache, v_cache, start, input_end, kv_len, scale, n_scores, block_table=None, *,
                  score_start=None, softcap=None, sinks=None):
    """q (B, H, R, D) (any strides, unit last); ranges (B, R) int32 or int64, each read with its own strides (stride 0
    over R: a (B,) range broadcast).
    score_start (B, R), same strides: where a row's score columns start when it differs from its attended start
    (a window; columns before the window stay -inf); softcap, sinks (H,): the layer's variant.
    v_cache None skips out; n_scores > 0 also returns the input keys' scores. With a block_table (B, pages)
    int32 the caches are paged, (P, page_size, H_kv, D) (V's last dimension D_v), and key j of item b is in page
    block_table[b, j // page_size]; otherwise they are (B, H_kv, S, D) (and D_v).

    Returns (out (B, H, R, D_v) in q's dtype or None, lse (B, H, R) float32, lse_gen (B, H, R) float32 (-inf
    where no generated key; it may also be -inf where the generated keys' share of the row is below about 2^-126:
    their weights are taken from the running max by fast_exp), scores (B, H, R, score_columns(n_scores)) float32 or
    None: input i of row (b, h, r) in column i + s % 16 where s is the row's score start, score_start or start);
    lse_gen and scores are views of the pass's workspace.
    """
    batch, heads, rows = q.shape[:3]
    dim_v = v_cache.shape[-1] if v_cache is not None else 0
    # Allocated before the split kernel: a fill of fresh memory (torch's deterministic mode) must not come between it
    # and the combine, its dependent.
    out = torch.empty(batch, heads, rows, dim_v, device=q.device, dtype=q.dtype) if v_cache is not None else None
    lse = torch.empty(batch, heads, rows, device=q.device, dtype=torch.float32)
    dependent = dependent_launch(q.device)
    split = _split(q, k_cache, v_cache, start, input_end, kv_len, scale, n_scores, block_table, score_start, softcap,
                   dependent)
    target = out if split.with_v else lse
    launch(
        _split_kv_combine_kernel, (batch * heads * rows,),
        split.workspace, target, lse, split.lse_gen, split.workspace if sinks is None else sinks,
        split.splits, heads, rows, split.stride_part, *(target.stride()[:3] if split.with_v else (0, 0, 0)),
        D=dim_v, BLOCK_D=head_block(dim_v), SPLITS_PAD=next_pow2(split.splits),
        SPLITS_CHUNK=splits_chunk(split.splits, dim_v), WITH_V=split.with_v, HAS_SINKS=sinks is not None, PDL=dependent,
        num_warps=4, **dependent_options(dependent),
    )
    return out, lse, split.lse_gen, split.scores


def fused_pass(q, k_cache, v_cache, start, input_end, kv_len, scale, target, *, pool_start, lse=None, alpha=None,
               pooling, redistribute, into_log_c, block_table=None, score_start=None, softcap=None, sinks=None):
    """The split-KV pass, then the head pooling of its input keys' probabilities into target (pool's log_c or out).
    Arguments as split_kv_pass's and pool's (pool_start, input_end: the pooled input range; lse (B, H, R) given
    replaces the computed one in the probabilities; alpha: log c's floor weight, into_log_c only). Returns (out or
    None, lse (B, H, R) computed)."""
    out, own_lse, lse_gen, scores = split_kv_pass(
        q, k_cache, v_cache, start, input_end, kv_len, scale, target.shape[-1], block_table,
        score_start=score_start, softcap=softcap, sinks=sinks)
    pool(scores, target, start, input_end, kv_len, _cache_keys(k_cache, block_table),
         column_start=None if score_start is None else pool_start, lse=own_lse if lse is None else lse,
         generated=lse_gen, alpha=alpha, pooling=pooling, redistribute=redistribute, into_log_c=into_log_c,
         after_combine=True)
    return out, own_lse


class _Split(NamedTuple):
    """What the split kernel left for the combine, in one float32 workspace (one allocation, not six: each costs
    microseconds of host time on a GPU): the per (row, slice) partials m, l, l_gen and (with_v) acc, each in a region
    `stride_part` floats long (acc: stride_part x D_v), then lse_gen (B, H, R), which the combine writes, and the input
    keys' scores (B, H, R, score_columns(n_scores)), the split kernel's (None without)."""
    splits: int
    with_v: bool
    workspace: torch.Tensor
    stride_part: int
    lse_gen: torch.Tensor
    scores: torch.Tensor | None


def _aligned(floats: int) -> int:
    """floats rounded up to a multiple of 16: every workspace region starts 64-byte aligned (the allocation itself is
    512-byte aligned), and Triton specialises their offsets as multiples of 16 (vector loads and stores)."""
    return -(-floats // 16) * 16


def score_columns(n_scores: int) -> int:
    """Columns of a row of the split pass's scores: its column 0 holds common.score_base of its score start, so its
    n_scores inputs start up to 15 columns in; a multiple of 16, each row 64-byte aligned."""
    return _aligned(n_scores + 15)


def _cache_keys(k_cache, block_table) -> int:
    """Keys per item: a contiguous cache's S, or the pages a table row names times their size."""
    return k_cache.shape[2] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def _split(q, k_cache, v_cache, start, input_end, kv_len, scale, n_scores, block_table, score_start, softcap,
           dependent):
    """Launch `_split_kv_kernel` (arguments as split_kv_pass's; dependent: the combine launches as its programmatic
    dependent) into a new workspace (a _Split)."""
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
    dim_v = v_cache.shape[-1] if with_v else dim
    dot_f32 = dot_in_f32(q, k_cache, *((v_cache,) if with_v else ()))
    tiles = split_kv_tiles(batch, kv_heads, group * rows, keys, max(dim, dim_v), dot_f32, q.device)
    query_rows = batch * heads * rows
    stride_part = _aligned(query_rows * tiles.splits)
    lse_gen_at = stride_part * (3 + dim_v if with_v else 3)
    scores_at = lse_gen_at + _aligned(query_rows)
    columns = score_columns(n_scores) if n_scores else 0
    workspace = torch.empty(scores_at + query_rows * columns, device=q.device, dtype=torch.float32)
    lse_gen = workspace.as_strided((batch, heads, rows), (heads * rows, rows, 1), lse_gen_at)
    windowed = score_start is not None
    scores = None
    if n_scores:
        scores = workspace.as_strided((batch, heads, rows, columns), (heads * rows * columns, rows * columns,
                                                                      columns, 1), scores_at)
        if windowed:
            scores.fill_(float("-inf"))
    v = v_cache if with_v else k_cache
    launch(
        _split_kv_kernel, (batch * kv_heads * cdiv(group * rows, tiles.block_m), tiles.splits),
        q, k_cache, v, start, input_end, kv_len, block_table if paged else start,
        score_start if windowed else start, lse_gen if scores is None else scores, workspace,
        scale, 1.0 if softcap is None else float(softcap), tiles.split_size, tiles.splits, kv_heads, rows,
        keys, columns, k_cache.shape[0] if paged else 0, stride_part,
        *q.stride()[:3], *k_strides, *(v_strides if with_v else k_strides),
        *start.stride(), *input_end.stride(), *kv_len.stride(), *(score_start if windowed else start).stride(),
        block_table.stride(0) if paged else 0,
        *(scores.stride()[:3] if n_scores else (0, 0, 0)),
        D=dim, BLOCK_D=head_block(dim), D_V=dim_v, BLOCK_DV=head_block(dim_v), GROUP=group, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        WITH_V=with_v, WITH_SCORES=bool(n_scores), DOT_F32=dot_f32, PAGE_SIZE=page_size,
        SOFTCAP=softcap is not None, WINDOWED=windowed, PDL=dependent,
        num_warps=tiles.num_warps, num_stages=3,
    )
    return _Split(tiles.splits, with_v, workspace, stride_part, lse_gen, scores)

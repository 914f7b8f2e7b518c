"""MACS's head pooling: m' = pool over heads of (p[h, i] + the head's generated mass / N), then either the
floor added to log_c, or m' itself written out.

`_pool_kernel` (grid (B * R, input blocks)) reads a tile of all H heads x BLOCK_I inputs of one query row.
It takes either given rows (B, H, S) with each head's generated mass, or the scores the split-KV pass
wrote with lse and lse_gen (then p = exp(s - lse) and the generated mass is exp(lse_gen - lse)).
`_generated_mass_kernel` (grid (B * H,)) sums given rows over the generated keys [input_end, kv_len).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from macs_kernels.ops.triton.common import (
    cdiv,
    clamped,
    dependent_launch,
    dependent_options,
    input_columns,
    launch,
    next_pow2,
    pool_block,
    row_block,
    score_base,
    wait_for_prior_grid,
)


@triton.jit
def _generated_mass_kernel(
    rows_ptr, input_end_ptr, kv_len_ptr, mass_ptr, heads, keys, stride_rb, stride_rh, stride_eb, stride_lb,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // heads
    base = rows_ptr + b * stride_rb + (row % heads) * stride_rh
    # Clamped into the row's keys, as the cuda kernels clamp an unchecked range.
    end = clamped(tl.load(kv_len_ptr + b * stride_lb), 0, keys)
    first = clamped(tl.load(input_end_ptr + b * stride_eb), 0, end)
    total = tl.zeros([BLOCK_S], tl.float32)
    for j0 in range(first, end, BLOCK_S):
        j = j0 + tl.arange(0, BLOCK_S)
        total += tl.load(base + j, mask=j < end, other=0.0).to(tl.float32)
    tl.store(mass_ptr + row, tl.sum(total, 0))


@triton.jit
def _pool_kernel(
    values_ptr, lse_ptr, gen_ptr, start_ptr, end_ptr, kv_len_ptr, column_start_ptr, target_ptr,
    alpha, heads, rows, n_target, n_columns, keys,
    stride_vb, stride_vh, stride_vr, stride_lb, stride_lh, stride_lr, stride_gb, stride_gh, stride_gr,
    stride_ib, stride_ir, stride_eb, stride_er, stride_kb, stride_kr, stride_pb, stride_pr, stride_tb, stride_tr,
    H_PAD: tl.constexpr, BLOCK_I: tl.constexpr, FROM_SCORES: tl.constexpr, REDISTRIBUTE: tl.constexpr,
    POOLING: tl.constexpr, INTO_LOG_C: tl.constexpr, WINDOWED: tl.constexpr, PDL: tl.constexpr,
):
    """PDL: launched as the split pass's combine's programmatic dependent: the ranges and log c (written before the
    split pass) are read while the combine ends, the scores, lse and lse_gen after it."""
    # Inductor passes Python floats as fp64 (a loop-carried max would turn fp64): the math stays fp32.
    alpha = tl.cast(alpha, tl.float32)
    b = (tl.program_id(0) // rows).to(tl.int64)
    r = (tl.program_id(0) % rows).to(tl.int64)
    column = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    start, n_input = input_columns(start_ptr, end_ptr, kv_len_ptr, column_start_ptr, b, r, keys, stride_ib, stride_ir,
                                   stride_eb, stride_er, stride_kb, stride_kr, stride_pb, stride_pr, WINDOWED)
    h = tl.arange(0, H_PAD)
    h_mask = h < heads
    if FROM_SCORES:
        # The split pass writes input i of a row in column i + start - score_base(start) of its n_columns (a multiple
        # of 16): a mask whole over every 16 columns reads 16-byte vectors. Given rows keep absolute key positions.
        i = column - (start - score_base(start))
        tile_mask = h_mask[:, None] & (column < n_columns)[None, :]
    else:
        i = column
        column = start + i
    # The row holds n_target columns (only an unchecked input range is longer).
    i_mask = (i >= 0) & (i < n_input) & (i < n_target)
    if not FROM_SCORES:
        tile_mask = h_mask[:, None] & i_mask[None, :]
    target = target_ptr + b * stride_tb + r * stride_tr + i
    if PDL:
        if INTO_LOG_C:
            log_c = tl.load(target, mask=i_mask)
        wait_for_prior_grid(PDL)
    x = tl.load(values_ptr + b * stride_vb + r * stride_vr + h[:, None] * stride_vh + column[None, :],
                mask=tile_mask, other=0.0).to(tl.float32)
    if INTO_LOG_C and not PDL:
        # Issued beside the tile's loads, not one round trip after the pooling (before them, its change of layout
        # through shared memory held the tile's loads back until it arrived).
        log_c = tl.load(target, mask=i_mask)
    if FROM_SCORES:
        lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + r * stride_lr, mask=h_mask, other=0.0)
        # Columns that no key block reached hold whatever the workspace held (NaN, huge): weight 0.
        x = tl.exp(tl.where(i_mask[None, :], x, float("-inf")) - lse.to(tl.float32)[:, None])
    gen = 0.0
    if REDISTRIBUTE:
        gen = tl.load(gen_ptr + b * stride_gb + h * stride_gh + r * stride_gr, mask=h_mask, other=0.0)
        if FROM_SCORES:
            gen = tl.exp(gen - lse)
    # Each head's generated mass spread over the n_input inputs; log(alpha * m' + 1 - alpha) added for i < n_input,
    # or m' written (0 for n_input <= i < n_target).
    if REDISTRIBUTE:
        x += gen[:, None] / n_input.to(tl.float32)
    if POOLING == "max":
        pooled = tl.max(tl.where(h_mask[:, None], x, float("-inf")), 0)
    elif POOLING == "min":
        pooled = tl.min(tl.where(h_mask[:, None], x, float("inf")), 0)
    else:
        pooled = tl.sum(tl.where(h_mask[:, None], x, 0.0), 0) / heads
    if INTO_LOG_C:
        # Efficient-attention rows can pool below zero; clamping keeps the floor's log defined.
        term = tl.log(alpha * tl.maximum(pooled, 0.0) + (1.0 - alpha))
        tl.store(target, log_c + term, mask=i_mask)
    else:
        tl.store(target, tl.where(i_mask, pooled, 0.0), mask=(i >= 0) & (i < n_target))


def pool(values, target, start, end, kv_len, keys, *, column_start=None, lse=None, generated=None, alpha=None,
         pooling="max", redistribute=True, into_log_c=True, after_combine=False):
    """Pool `values` over heads into `target` for each query row.

    values: the split pass's scores (B, H, R, split_kv.score_columns(N_max)) (input i of a row in column
        i + s % 16, s its inputs' start) with lse and generated = lse_gen (B, H, R), or rows (B, H, S) (R = 1) with
        generated = each head's generated mass (B, H) float32 (lse None).
    start, end, kv_len: (B, R) int32 or int64, each read with its own strides (stride 0 over R allowed): the
        attended keys [start, kv_len) of a cache of `keys` keys, inputs [start, end), or [column_start, end) (a
        window's inputs, which may start before the attended start); clamped as the split pass clamps them.
    target: log_c (B, N_max) to which log(alpha * m' + 1 - alpha) is added for i < N (into_log_c), or
        out (B, R, N_max) that receives m' for i < N and 0 after.
    alpha: the floor weight of log c's update (into_log_c: required); None where m' is written.
    after_combine: launched right after the split pass's combine, which wrote lse and generated: it may launch as the
        combine's programmatic dependent (common.dependent_launch).
    """
    if into_log_c and alpha is None:
        raise ValueError("pool into log_c needs alpha")
    from_scores = lse is not None
    values4 = values if from_scores else values[:, :, None]
    batch, heads, rows = values4.shape[:3]
    target3 = target.view(batch, rows, -1)
    n_target = target3.shape[-1]
    gen = generated if generated is not None else values4  # not read: REDISTRIBUTE is off
    gen3 = gen if gen.dim() != 2 else gen[:, :, None]
    lse3 = lse if from_scores else values4
    n_columns = values4.shape[-1] if from_scores else n_target
    block_i = pool_block(heads, n_columns)
    windowed = column_start is not None
    column_start = column_start if windowed else start
    dependent = after_combine and dependent_launch(values.device)
    launch(
        _pool_kernel, (batch * rows, cdiv(n_columns, block_i)),
        values4, lse3, gen3, start, end, kv_len, column_start, target3,
        float(alpha) if into_log_c else 0.0, heads, rows, n_target, n_columns, keys,
        values4.stride(0), values4.stride(1), values4.stride(2), lse3.stride(0), lse3.stride(1), lse3.stride(2),
        gen3.stride(0), gen3.stride(1), gen3.stride(2), *start.stride(), *end.stride(), *kv_len.stride(),
        *column_start.stride(), target3.stride(0), target3.stride(1),
        H_PAD=next_pow2(heads), BLOCK_I=block_i, FROM_SCORES=from_scores, REDISTRIBUTE=redistribute,
        POOLING=pooling, INTO_LOG_C=into_log_c, WINDOWED=windowed, PDL=dependent, num_warps=4,
        **dependent_options(dependent),
    )


def generated_mass(rows, input_end, kv_len):
    """(B, H) float32: each head's sum of rows (B, H, S) over keys [input_end, kv_len) ((B,), any strides: the
    engines pass a column of their (B, R) lengths)."""
    batch, heads, keys = rows.shape
    mass = torch.empty(batch, heads, device=rows.device, dtype=torch.float32)
    launch(
        _generated_mass_kernel, (batch * heads,),
        rows, input_end, kv_len, mass, heads, keys, rows.stride(0), rows.stride(1), input_end.stride(0),
        kv_len.stride(0),
        BLOCK_S=row_block(keys), num_warps=4,
    )
    return mass

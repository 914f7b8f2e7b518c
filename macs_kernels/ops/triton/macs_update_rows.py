"""MACS log-consistency update from attention values: the head pooling, redistribution and floor.

`_macs_pool_kernel` (grid (B, input blocks)) reads a tile of all H heads x BLOCK_I inputs, pools it
over the heads and adds log(alpha * pooled + 1 - alpha) to log_c. It takes either given rows (B, H, S)
with each head's generated mass, or the scores the split-KV pass wrote with lse and lse_gen (then
p = exp(s - lse) and the generated mass is exp(lse_gen - lse)).
`_generated_mass_kernel` (grid (B * H,)) sums given rows over the generated keys [input_end, kv_len).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import interpreted, launch, next_pow2


@triton.jit
def _generated_mass_kernel(
    rows_ptr, input_end_ptr, kv_len_ptr, mass_ptr, heads, stride_rb, stride_rh, BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // heads
    base = rows_ptr + b * stride_rb + (row % heads) * stride_rh
    end = tl.load(kv_len_ptr + b)
    total = tl.zeros([BLOCK_S], tl.float32)
    for j0 in range(tl.load(input_end_ptr + b), end, BLOCK_S):
        j = j0 + tl.arange(0, BLOCK_S)
        total += tl.load(base + j, mask=j < end, other=0.0).to(tl.float32)
    tl.store(mass_ptr + row, tl.sum(total, 0))


@triton.jit
def _macs_pool_kernel(
    values_ptr, lse_ptr, gen_ptr, start_ptr, end_ptr, log_c_ptr,
    alpha, heads, stride_vb, stride_vh, stride_lb, stride_lh, stride_gb, stride_cb,
    H_PAD: tl.constexpr, BLOCK_I: tl.constexpr, FROM_SCORES: tl.constexpr, REDISTRIBUTE: tl.constexpr,
    POOLING: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    start = tl.load(start_ptr + b)
    n_input = tl.load(end_ptr + b) - start
    i_mask = i < n_input
    h = tl.arange(0, H_PAD)
    h_mask = h < heads
    tile_mask = h_mask[:, None] & i_mask[None, :]
    if FROM_SCORES:
        # The split pass writes input i of row b in column i; given rows keep absolute key positions.
        column = i
    else:
        column = start + i
    x = tl.load(values_ptr + b * stride_vb + h[:, None] * stride_vh + column[None, :], mask=tile_mask,
                other=0.0).to(tl.float32)
    if FROM_SCORES:
        lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh, mask=h_mask, other=0.0).to(tl.float32)
        x = tl.exp(x - lse[:, None])
    if REDISTRIBUTE:
        gen = tl.load(gen_ptr + b * stride_gb + h, mask=h_mask, other=0.0)
        if FROM_SCORES:
            gen = tl.exp(gen - lse)
        x += gen[:, None] / n_input.to(tl.float32)
    if POOLING == "max":
        pooled = tl.max(tl.where(h_mask[:, None], x, float("-inf")), 0)
    elif POOLING == "min":
        pooled = tl.min(tl.where(h_mask[:, None], x, float("inf")), 0)
    else:
        pooled = tl.sum(tl.where(h_mask[:, None], x, 0.0), 0) / heads
    # Efficient-attention rows can pool below zero; clamping keeps the floor's log defined.
    term = tl.log(alpha * tl.maximum(pooled, 0.0) + (1.0 - alpha))
    target = log_c_ptr + b * stride_cb + i
    tl.store(target, tl.load(target, mask=i_mask) + term, mask=i_mask)


def pool_into_log_c(values, log_c, *, input_start, input_end, lse, lse_gen, alpha, pooling, redistribute,
                    generated_mass=None):
    """log_c[b, :N_b] += log(alpha * pool_h(p[b, h, i] + g[b, h] / N_b) + 1 - alpha).

    values: scores (B, H, N_max) with lse and lse_gen (B, H), or rows (B, H, S) with generated_mass
    (B, H) float32 (lse None).
    """
    batch, heads = values.shape[:2]
    n_max = log_c.shape[1]
    h_pad = next_pow2(heads)
    # One tile holds every head of BLOCK_I inputs; the interpreter prefers few, large tiles.
    block_i = max(16, min(next_pow2(n_max), (16384 if interpreted() else 4096) // h_pad))
    from_scores = lse is not None
    gen = lse_gen if from_scores else generated_mass
    if gen is None:
        gen = log_c  # not read: REDISTRIBUTE is off
    launch(
        _macs_pool_kernel, (batch, triton.cdiv(n_max, block_i)),
        values, lse if from_scores else values, gen, input_start, input_end, log_c,
        alpha, heads, values.stride(0), values.stride(1),
        lse.stride(0) if from_scores else 0, lse.stride(1) if from_scores else 0, gen.stride(0), log_c.stride(0),
        H_PAD=h_pad, BLOCK_I=block_i, FROM_SCORES=from_scores, REDISTRIBUTE=redistribute, POOLING=pooling,
        num_warps=4,
    )


def macs_update_rows(rows, log_c, *, input_start, input_end, kv_len, alpha, pooling, redistribute):
    """rows (B, H, S) any float dtype; log_c (B, N_max) float32 updated in place."""
    batch, heads, _ = rows.shape
    mass = None
    if redistribute:
        mass = torch.empty(batch, heads, device=rows.device, dtype=torch.float32)
        launch(
            _generated_mass_kernel, (batch * heads,),
            rows, input_end, kv_len, mass, heads, rows.stride(0), rows.stride(1),
            BLOCK_S=1024 if interpreted() else 512, num_warps=4,
        )
    pool_into_log_c(
        rows, log_c, input_start=input_start, input_end=input_end, lse=None, lse_gen=None,
        alpha=alpha, pooling=pooling, redistribute=redistribute, generated_mass=mass,
    )

"""Efficient attention, Triton back-projection: a_eff = W X^T over key tiles, with a_eff X on the way.

The Gram matrices of X = [V, 1], the float64 solve W = o G^+ and the residual are shared with the torch
backend (ops/torch/efficient.py); only the pass over the cache runs here.
`_efficient_back_projection_kernel` (grid (B * H_kv, key splits, row tiles)): the G query heads x R rows
of one KV head form M = G * R rows of W; per key tile it computes the (BLOCK_M x BLOCK_S) block
W[:, :D] V^T + W[:, D] (the ones column of X is a bias), zeroes keys outside each row's range, stores it,
and accumulates a_eff X for the residual. Key tiles are split over programs for parallelism at decode
(M is only G there); each split writes its partial a_eff X, summed on the host (no atomics).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from macs_kernels.ops.torch.efficient import project_rows
from macs_kernels.ops.triton.common import back_projection_tiles, cdiv, dot, head_block, launch, multiprocessors


@triton.jit
def _efficient_back_projection_kernel(
    w_ptr, v_ptr, out_ptr, partial_ptr, start_ptr, kv_len_ptr,
    kv_heads, rows_m, rows_r, keys, dim, stride_vb, stride_vh, stride_vs,
    CAUSAL: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    b = head // kv_heads
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < rows_m
    start = tl.load(start_ptr + b).to(tl.int32)
    length = tl.load(kv_len_ptr + b).to(tl.int32)
    if CAUSAL:
        # Row m is query head m // R, query r = m % R: the r-th of the last R positions of the cache.
        ends = length - rows_r + m % rows_r + 1
    else:
        ends = tl.zeros([BLOCK_M], tl.int32) + length
    d = tl.arange(0, BLOCK_D)
    d_mask = d < dim
    width = dim + 1
    w_rows = w_ptr + (head * rows_m + m) * width
    w = tl.load(w_rows[:, None] + d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(COMPUTE)
    w_ones = tl.load(w_rows + dim, mask=m_mask, other=0.0).to(COMPUTE)
    v_base = v_ptr + b * stride_vb + (head % kv_heads) * stride_vh
    out_rows = out_ptr + (head * rows_m + m) * keys
    reproduced = tl.zeros([BLOCK_M, BLOCK_D], COMPUTE)
    mass = tl.zeros([BLOCK_M], COMPUTE)
    first = start // BLOCK_S
    tiles = tl.cdiv(length, BLOCK_S) - first
    per_split = tl.cdiv(tiles, splits)
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, first + tiles)
    for tile in range(lo, hi):
        j = tile * BLOCK_S + tl.arange(0, BLOCK_S)
        v = tl.load(v_base + j[:, None] * stride_vs + d[None, :], mask=(j < length)[:, None] & d_mask[None, :],
                    other=0.0).to(COMPUTE)
        a = dot(w, tl.trans(v), True) + w_ones[:, None]
        inside = (j[None, :] >= start) & (j[None, :] < ends[:, None]) & m_mask[:, None]
        a = tl.where(inside, a, 0.0)
        tl.store(out_rows[:, None] + j[None, :], a, mask=inside)
        reproduced += dot(a, v, True)
        mass += tl.sum(a, 1)
    partial_rows = partial_ptr + ((split * tl.num_programs(0) + head) * rows_m + m) * width
    tl.store(partial_rows[:, None] + d[None, :], reproduced, mask=m_mask[:, None] & d_mask[None, :])
    tl.store(partial_rows + dim, mass, mask=m_mask)


def back_project(coefficients, v_cache, kv_start, kv_len, causal):
    """Triton version of torch_efficient.torch_back_project: W (B, H, R, E) contiguous -> (a_eff, a_eff X)."""
    batch, heads, rows, width = coefficients.shape
    kv_heads, keys, dim = v_cache.shape[1:]
    rows_m = heads // kv_heads * rows
    block_m, block_s, num_warps = back_projection_tiles(rows_m, keys, dim)
    block_d = head_block(dim)
    row_tiles = cdiv(rows_m, block_m)
    splits = max(1, min(cdiv(keys, block_s), cdiv(2 * multiprocessors(v_cache.device), batch * kv_heads * row_tiles)))
    a_eff = torch.zeros(batch, heads, rows, keys, dtype=coefficients.dtype, device=coefficients.device)
    partial = torch.empty(splits, batch, heads, rows, width, dtype=coefficients.dtype, device=coefficients.device)
    launch(
        _efficient_back_projection_kernel, (batch * kv_heads, splits, row_tiles),
        coefficients, v_cache, a_eff, partial, kv_start, kv_len,
        kv_heads, rows_m, rows, keys, dim, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        CAUSAL=causal, COMPUTE=tl.float64 if coefficients.dtype == torch.float64 else tl.float32,
        BLOCK_M=block_m, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=num_warps,
    )
    return a_eff, partial.sum(dim=0)


def efficient_attention(p, v_cache, kv_start, kv_len, causal, rcond, gram=None):
    return project_rows(p, v_cache, kv_start, kv_len, causal, rcond, gram, back_project)

"""z-scores of c = exp(log_c) per row over its first n_input[b] entries (zeros after), one program per row.

Four sweeps over the row (max, mean, centred variance, write): the row is small and the centred
variance avoids the cancellation of E[c^2] - E[c]^2 when the c are nearly equal.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from macs_kernels.ops.triton.common import clamped, launch, row_block


@triton.jit
def _macs_zscore_kernel(log_c_ptr, n_ptr, out_ptr, n_max, stride_lb, stride_ob, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = log_c_ptr + b * stride_lb
    # An unchecked count past the row reads only the row, as the cuda kernel does.
    n = clamped(tl.load(n_ptr + b), 0, n_max)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(row + i, mask=i < n, other=float("-inf")))
    top_all = tl.max(top, 0)
    # z does not change when c is scaled; a row of -inf (all attention underflowed) gets zeros.
    finite = (top_all > float("-inf")) & (top_all < float("inf"))
    shift = tl.where(finite, top_all, 0.0)
    total = tl.zeros([BLOCK], tl.float32)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        total += tl.exp(tl.load(row + i, mask=i < n, other=float("-inf")) - shift)
    count = n.to(tl.float32)
    mean = tl.sum(total, 0) / count
    squares = tl.zeros([BLOCK], tl.float32)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        centred = tl.exp(tl.load(row + i, mask=i < n, other=float("-inf")) - shift) - mean
        squares += tl.where(i < n, centred * centred, 0.0)
    std = tl.sqrt(tl.sum(squares, 0) / count)
    inverse = tl.where(finite & (std > 0.0), 1.0 / std, 0.0)
    for i0 in range(0, n_max, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        c = tl.exp(tl.load(row + i, mask=i < n, other=float("-inf")) - shift)
        tl.store(out_ptr + b * stride_ob + i, tl.where(i < n, (c - mean) * inverse, 0.0), mask=i < n_max)


def macs_zscore(log_c, n_input):
    """log_c (B, N_max) float32, n_input (B,) -> z (B, N_max) float32."""
    batch, n_max = log_c.shape
    out = torch.empty(batch, n_max, device=log_c.device, dtype=torch.float32)
    launch(_macs_zscore_kernel, (batch,), log_c, n_input, out, n_max, log_c.stride(0), out.stride(0),
           BLOCK=row_block(n_max), num_warps=4)
    return out

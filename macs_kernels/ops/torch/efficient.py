"""Efficient attention in PyTorch: Gram matrices of [V, 1], their solve, and the back-projection.

A softmax row p over keys with values X = [V, 1] gives the output o = p X. The part of p that o depends on
is its projection onto the column space of X: a_eff = o G^+ X^T with G = X^T X ((D+1) x (D+1)). Everything
up to the coefficients W = o G^+ is small and runs here in float64 for every backend (the Gram matrices
of bf16/fp16/fp32 values are exact sums of exact products in float64); the back-projection W X^T reads
the whole cache and is what a backend supplies (`torch_back_project` here, a Triton kernel in
ops/triton/efficient_attention.py). Both return a_eff X as well, from which the residual is measured.
"""
from __future__ import annotations

import torch
from torch import Tensor

from macs_kernels.ops.torch.row import outside_range

# Eigenvalues of G below DEFAULT_RCOND * max eigenvalue are treated as zero: singular values of X below
# 1e-5 of the largest. float64 Gram matrices of n keys carry rounding of about n * 1e-16 relative.
DEFAULT_RCOND = 1e-10


def key_ends(kv_start, kv_len, rows, causal):
    """(B, R) end of each row's keys; every row starts at kv_start. Causal rows are the last R queries."""
    if causal:
        return kv_len[:, None] - rows + 1 + torch.arange(rows, device=kv_len.device)
    return kv_len[:, None].expand(-1, rows)


def key_mask(kv_start, ends, keys):
    """(B, R, S) True where key j lies in row r's range [kv_start, ends[:, r])."""
    return ~outside_range(keys, kv_start[:, None], ends)


def augmented(values, dtype):
    """X = [V, 1]: (B, H_kv, S, D) -> (B, H_kv, S, D + 1) in `dtype`."""
    values = values.to(dtype)
    return torch.cat([values, values.new_ones(values.shape[:-1] + (1,))], dim=-1)


def gram_matrices(x, kv_start, ends, causal):
    """float64 X^T X over each row's keys: (B, H_kv, 1, E, E), or (B, H_kv, R, E, E) when causal.

    Causal rows differ by one key each: the Gram of the keys before the first row's last key, then a
    cumulative sum of the R rank-1 terms (memory O(R E^2) per KV head).
    """
    if not causal:
        inside = key_mask(kv_start, ends[:, :1], x.shape[2])[:, 0]
        xm = x * inside[:, None, :, None]
        return (xm.transpose(-1, -2) @ xm)[:, :, None]
    inside = key_mask(kv_start, ends[:, :1] - 1, x.shape[2])[:, 0]
    xm = x * inside[:, None, :, None]
    base = xm.transpose(-1, -2) @ xm
    last_keys = ends - 1
    last = x.gather(2, last_keys.clamp_min(0)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))
    last = last * (last_keys >= kv_start[:, None])[:, None, :, None]
    return base[:, :, None] + torch.cumsum(last[..., :, None] * last[..., None, :], dim=2)


def solve_coefficients(gram, rhs, rcond):
    """G^+ rhs for symmetric positive semi-definite G (..., E, E) and rhs (..., E, K), in float64.

    Cholesky when it succeeds and every pivot exceeds rcond * max diag(G) (a pivot is the squared distance
    of one column of X from the span of the previous ones, so an exactly rank-deficient X, e.g. a constant
    or duplicated value channel, always fails this test). Otherwise the eigendecomposition pseudo-inverse,
    dropping eigenvalues below rcond * the largest. Eagerly, the decomposition runs on the failed matrices only,
    which costs a host sync on a GPU to find them; inside torch.compile it runs on every matrix, and the
    Cholesky solve is kept where it succeeded (no data-dependent branch or shape). On a GPU eigh itself reads
    its error code on the host, so this op cannot be captured in a CUDA graph there.
    """
    factor, info = torch.linalg.cholesky_ex(gram)
    pivots = factor.diagonal(dim1=-2, dim2=-1).square()
    scale = gram.diagonal(dim1=-2, dim2=-1).amax(dim=-1)
    solvable = (info == 0) & (pivots.amin(dim=-1) > rcond * scale)
    out = torch.cholesky_solve(rhs, factor)
    if torch.compiler.is_compiling():
        return torch.where(solvable[..., None, None], out, _pseudo_inverse_solve(gram, rhs, rcond))
    if not bool(solvable.all()):
        singular = ~solvable
        out[singular] = _pseudo_inverse_solve(gram[singular], rhs[singular], rcond)
    return out


def _pseudo_inverse_solve(gram, rhs, rcond):
    """G^+ rhs through the eigendecomposition of G, eigenvalues below rcond * the largest taken as zero."""
    eigenvalues, vectors = torch.linalg.eigh(gram)
    keep = eigenvalues > rcond * eigenvalues.amax(dim=-1, keepdim=True)
    inverse = torch.where(keep, 1.0 / torch.where(keep, eigenvalues, 1.0), 0.0)
    return vectors @ (inverse[..., None] * (vectors.transpose(-1, -2) @ rhs))


def torch_back_project(coefficients, v_cache, kv_start, kv_len, causal):
    """a_eff[b, h, r, j] = W[b, h, r] . X[b, h // G, j] inside row r's keys, 0 outside, and a_eff X.

    coefficients: (B, H, R, E) in the compute dtype. Returns a_eff (B, H, R, S) and a_eff X (B, H, R, E).
    """
    ends = key_ends(kv_start, kv_len, coefficients.shape[2], causal)
    batch, heads, rows, width = coefficients.shape
    kv_heads, keys = v_cache.shape[1], v_cache.shape[2]
    x = augmented(v_cache, coefficients.dtype)
    grouped = coefficients.reshape(batch, kv_heads, -1, width)
    a_eff = (grouped @ x.transpose(-1, -2)).view(batch, heads, rows, keys)
    a_eff = a_eff * key_mask(kv_start, ends, keys)[:, None]
    reproduced = a_eff.view(batch, kv_heads, -1, keys) @ x
    return a_eff, reproduced.view(batch, heads, rows, width)


def efficient_attention(
    p: Tensor, v_cache: Tensor, kv_start: Tensor, kv_len: Tensor, causal: bool, rcond: float,
    gram: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Efficient rows of p (B, H, R, S) over values (B, H_kv, S, D); see ops.efficient_attention.

    gram: optional (B, H_kv, D+1, D+1) float64 X^T X over [kv_start, kv_len) (a GramState's), used
    instead of recomputing it; only for causal=False.
    """
    return project_rows(p, v_cache, kv_start, kv_len, causal, rcond, gram, torch_back_project)


def project_rows(p, v_cache, kv_start, kv_len, causal, rcond, gram, back_project):
    """efficient_attention with the backend's back-projection W X^T (torch_back_project's signature)."""
    batch, heads, rows, keys = p.shape
    kv_heads, width = v_cache.shape[1], v_cache.shape[3] + 1
    group = heads // kv_heads
    dtype = torch.float64 if torch.float64 in (p.dtype, v_cache.dtype) else torch.float32
    # Ranges that no check read (validate=False, a GPU's default) are clamped into the cache, as every kernel clamps
    # them: wrong numbers, never a gather past the cache (on a GPU, a device-side assert that ends the context).
    kv_len = kv_len.clamp(0, keys)
    kv_start = torch.minimum(kv_start.clamp_min(0), kv_len)
    ends = key_ends(kv_start, kv_len, rows, causal)
    inside = key_mask(kv_start, ends, keys)
    x = augmented(v_cache, torch.float64)
    p64 = p.double() * inside[:, None]
    outputs = (p64.view(batch, kv_heads, group * rows, keys) @ x).view(batch, kv_heads, group, rows, width)
    grams = gram_matrices(x, kv_start, ends, causal) if gram is None else gram[:, :, None]
    solves = grams.shape[2]
    # A row with at most D + 1 keys is generically its own projection and is returned as is; the
    # identity stands in for its (singular) Gram so that it does not send the batch to the fallback.
    short = (ends - kv_start[:, None]) <= width
    identity = torch.eye(width, dtype=torch.float64, device=p.device)
    grams = torch.where(short[:, None, :solves, None, None], identity, grams)
    # Rows that share a Gram matrix are solved together: (B, H_kv, solves, E, G * R / solves).
    per_solve = rows // solves
    rhs = outputs.view(batch, kv_heads, group, solves, per_solve, width).permute(0, 1, 3, 5, 2, 4)
    solved = solve_coefficients(grams, rhs.reshape(batch, kv_heads, solves, width, -1), rcond)
    coefficients = (
        solved.view(batch, kv_heads, solves, width, group, per_solve).permute(0, 1, 4, 2, 5, 3)
        .reshape(batch, heads, rows, width)
    )
    a_eff, reproduced = back_project(coefficients.to(dtype).contiguous(), v_cache, kv_start, kv_len, causal)
    a_eff = torch.where(short[:, None, :, None], p64.to(dtype), a_eff)
    outputs = outputs.view(batch, heads, rows, width)
    error = torch.linalg.vector_norm(reproduced.double() - outputs, dim=-1)
    norm = torch.linalg.vector_norm(outputs, dim=-1)
    residual = torch.where(norm > 0, error / torch.where(norm > 0, norm, 1.0), error)
    return a_eff, residual.masked_fill_(short[:, None], 0.0).to(dtype)

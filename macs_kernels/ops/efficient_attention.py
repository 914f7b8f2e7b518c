"""Public op efficient_attention: the part of each attention row that the head's output depends on."""
from __future__ import annotations

import torch

from macs_kernels.ops._checks import (
    IndexLike,
    as_index,
    check_ranges,
    check_tensor,
    invalid_entry,
    values_to_check,
    zeros_index,
)
from macs_kernels.ops.library import define_operator
from macs_kernels.ops.registry import kernel
from macs_kernels.ops.torch import efficient as torch_efficient
from macs_kernels.ops.torch.efficient import DEFAULT_RCOND


def _fake(p, v_cache, kv_start, kv_len, causal, rcond, gram=None):
    dtype = torch.float64 if torch.float64 in (p.dtype, v_cache.dtype) else torch.float32
    return p.new_empty(p.shape, dtype=dtype), p.new_empty(p.shape[:3], dtype=dtype)


operator = define_operator(torch_efficient.efficient_attention, fake=_fake)


def check_efficient_args(p, v_cache, kv_start, kv_len, rcond, *, causal=False, validate=None):
    """Validate efficient_attention's arguments (values where and when `validate` says: see ops._checks); returns
    (kv_start, kv_len) as (B,) int32 or int64."""
    check_tensor("p", p, 4)
    check_tensor("v_cache", v_cache, 4)
    batch, heads, rows, keys = p.shape
    if v_cache.shape[0] != batch or v_cache.shape[2] != keys:
        raise ValueError(
            f"v_cache must be ({batch}, H_kv, {keys}, D) to match p {tuple(p.shape)}, got {tuple(v_cache.shape)}"
        )
    if not v_cache.shape[1] or heads % v_cache.shape[1]:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({v_cache.shape[1]})")
    if not isinstance(causal, bool):  # bool("no") would be True
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if v_cache.device != p.device:
        raise ValueError(f"p is on {p.device} but v_cache is on {v_cache.device}")
    if isinstance(rcond, bool) or not isinstance(rcond, (int, float)) or not 0.0 <= rcond < 1.0:
        raise ValueError(f"rcond must be a number in [0, 1), got {rcond!r}")
    kv_len = as_index("kv_len", kv_len, batch, p.device)
    kv_start = (zeros_index(batch, p.device, kv_len.dtype) if kv_start is None
                else as_index("kv_start", kv_start, batch, p.device))
    check_ranges(kv_start, kv_len, kv_len, keys, validate=validate)
    values = values_to_check(validate, kv_len) if causal else None
    if values is not None:
        message = f"causal rows are the last R={rows} queries of the cache: kv_len must be >= {rows}"
        if invalid_entry(values[0] >= rows, message) is not None:
            raise ValueError(message)
    return kv_start, kv_len


def efficient_attention(
    p: torch.Tensor, v_cache: torch.Tensor, *, kv_len: IndexLike, kv_start: IndexLike | None = None,
    causal: bool = False, rcond: float = DEFAULT_RCOND, backend: str | None = None, validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Efficient attention rows: each softmax row projected onto the span of its keys' [V, 1].

    p: (B, H, R, S) attention rows (softmax probabilities; any rows are accepted).
    v_cache: (B, H_kv, S, D) values; query head h reads KV head h // (H // H_kv).
    kv_len, kv_start: (B,) row b attends keys [kv_start, kv_len) (kv_start defaults to 0). With
        causal=True the R rows are the last R queries of the cache: row r attends [kv_start, kv_len - R + r + 1).
    rcond: eigenvalues of X^T X below rcond * the largest count as zero (see torch_efficient.solve_coefficients).

    With X = [V, 1] over a row's n keys and o = p X: a_eff = o (X^T X)^+ X^T, the orthogonal projection of p
    onto col(X). a_eff X = p X (it gives the same attention output and the same row sum), and a_eff is the
    same for every row with that output and sum. A row with n <= D + 1 keys is returned as is. Entries
    outside a row's keys are 0 (whatever p holds there). a_eff can be negative.
    Returns (a_eff (B, H, R, S), residual (B, H, R) = ||a_eff X - p X|| / ||p X||), float64 when p or
    v_cache is float64, else float32. X^T X and the solve are float64 on every backend.
    validate: check the index values (None: only where free, i.e. CPU tensors; True: always, one host sync on a
        GPU; False: never; see docs/api.md, "Argument checks").
    """
    kv_start, kv_len = check_efficient_args(p, v_cache, kv_start, kv_len, rcond, causal=causal, validate=validate)
    return kernel(backend, p.device, "efficient_attention")(p, v_cache, kv_start, kv_len, bool(causal), float(rcond))

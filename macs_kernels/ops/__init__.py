"""Public ops: argument checks, then the chosen backend's kernel.

Conventions shared by every op:
- (B,) index tensors are int32 or int64 (Python ints and sequences are accepted too); key positions are
  absolute slots of the cache, so with left padding `kv_len` = pads + tokens in use;
- query head h reads KV head h // (H // H_kv) (grouped-query attention);
- any float dtype in, float32 accumulation; the last dimension must have unit stride;
- `backend`: "torch", "triton", "cuda", or None for the best available on the tensors' device (never the
  Triton interpreter); a backend named but unavailable raises `BackendUnavailable`.

Checks that read index values synchronise with the device once per call; the generation tracer resolves
the kernel once and calls it directly, so it pays no such cost per layer.
"""
from __future__ import annotations

import torch

from ..config import MacsConfig
from ._checks import check_lse, check_log_c, check_q_k, check_ranges, check_tensor, as_index
from ._dispatch import BackendUnavailable, kernel, resolve_backend
from .attention_features import attention_features
from .efficient_attention import efficient_attention

__all__ = [
    "BackendUnavailable",
    "attention_features",
    "decode_attention",
    "efficient_attention",
    "macs_update",
    "macs_update_rows",
    "macs_zscore",
    "resolve_backend",
]


def macs_update(
    q, k_cache, log_c, *, input_start, input_end, kv_len, scale, alpha=0.8, pooling="max",
    redistribute=True, lse=None, backend=None,
) -> None:
    """Add one layer's MACS term to the log consistency state, in place.

    q: (B, H, D), the last query of this forward pass, post-RoPE.
    k_cache: (B, H_kv, S, D). Keys [0, input_start) and [kv_len, S) are not attended (left pads, unused
        static-cache slots); [input_start, input_end) are the N_b inputs; [input_end, kv_len) are
        generated tokens, whose attention is spread evenly over the inputs when `redistribute`.
    log_c: (B, N_max) float32, N_max >= max N_b: log_c[b, i] += log(alpha * m'[b, i] + 1 - alpha) for
        i < N_b, m' being the head-pooled row of input i; entries i >= N_b are left as they are.
    lse: optional (B, H) natural-log log-sum-exp of q.k * scale over the attended keys (as FlashAttention
        returns it); given, the op makes one pass over K.
    """
    MacsConfig(alpha=alpha, pooling=pooling, redistribute=redistribute, backend=backend)
    check_q_k(q, k_cache)
    batch, heads, _ = q.shape
    check_log_c(log_c, batch, q.device)
    check_lse(lse, (batch, heads), q.device)
    input_start, input_end, kv_len = (
        as_index(name, value, batch, q.device)
        for name, value in (("input_start", input_start), ("input_end", input_end), ("kv_len", kv_len))
    )
    check_ranges(input_start, input_end, kv_len, k_cache.shape[2], log_c.shape[1])
    kernel(backend, q.device, "macs_update")(
        q, k_cache, log_c, input_start=input_start, input_end=input_end, kv_len=kv_len, scale=float(scale),
        alpha=float(alpha), pooling=pooling, redistribute=redistribute, lse=lse,
    )


def macs_update_rows(
    rows, log_c, *, input_start, input_end, kv_len, alpha=0.8, pooling="max", redistribute=True, backend=None
) -> None:
    """`macs_update` from given attention rows (B, H, S) instead of q and K (efficient attention, other tools).

    Entries of `rows` outside [input_start, kv_len) are ignored.
    """
    MacsConfig(alpha=alpha, pooling=pooling, redistribute=redistribute, backend=backend)
    check_tensor("rows", rows, 3)
    batch = rows.shape[0]
    check_log_c(log_c, batch, rows.device)
    input_start, input_end, kv_len = (
        as_index(name, value, batch, rows.device)
        for name, value in (("input_start", input_start), ("input_end", input_end), ("kv_len", kv_len))
    )
    check_ranges(input_start, input_end, kv_len, rows.shape[2], log_c.shape[1])
    kernel(backend, rows.device, "macs_update_rows")(
        rows, log_c, input_start=input_start, input_end=input_end, kv_len=kv_len,
        alpha=float(alpha), pooling=pooling, redistribute=redistribute,
    )


def macs_zscore(log_c, n_input, *, backend=None) -> torch.Tensor:
    """z-scores of c = exp(log_c) per row over its first n_input[b] entries; zeros after.

    log_c: (B, N_max) float32; n_input: (B,). Returns (B, N_max) float32. Computed as exp(log_c - max)
    (z does not change when c is scaled), with the population standard deviation; a row whose standard
    deviation is 0, or whose entries are all -inf, gets zeros.
    """
    check_tensor("log_c", log_c, 2)
    check_log_c(log_c, log_c.shape[0], log_c.device)
    n_input = as_index("n_input", n_input, log_c.shape[0], log_c.device)
    counts = n_input.cpu()
    if bool(((counts < 1) | (counts > log_c.shape[1])).any()):
        raise ValueError(f"n_input must lie in [1, {log_c.shape[1]}], got {counts.tolist()}")
    return kernel(backend, log_c.device, "macs_zscore")(log_c, n_input)


def decode_attention(
    q, k_cache, v_cache, *, kv_start=None, kv_len, scale, log_c=None, input_end=None, alpha=0.8,
    pooling="max", redistribute=True, backend=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per sequence over keys [kv_start, kv_len), optionally fused with `macs_update`.

    q: (B, H, D); k_cache, v_cache: (B, H_kv, S, D). kv_start: (B,) left pads (default 0).
    Returns out (B, H, D) in q's dtype and lse (B, H) float32 (natural log). With `log_c` (B, N_max) and
    `input_end` (B,), also performs macs_update with input_start = kv_start, reading K once.
    """
    MacsConfig(alpha=alpha, pooling=pooling, redistribute=redistribute, backend=backend)
    check_q_k(q, k_cache, v_cache)
    batch = q.shape[0]
    kv_len = as_index("kv_len", kv_len, batch, q.device)
    kv_start = as_index("kv_start", 0 if kv_start is None else kv_start, batch, q.device)
    if log_c is None:
        if input_end is not None:
            raise ValueError("input_end is only meaningful together with log_c")
        check_ranges(kv_start, kv_len, kv_len, k_cache.shape[2])
    else:
        if input_end is None:
            raise ValueError("log_c needs input_end (the end of the input keys)")
        check_log_c(log_c, batch, q.device)
        input_end = as_index("input_end", input_end, batch, q.device)
        check_ranges(kv_start, input_end, kv_len, k_cache.shape[2], log_c.shape[1])
    return kernel(backend, q.device, "decode_attention")(
        q, k_cache, v_cache, kv_start=kv_start, kv_len=kv_len, scale=float(scale), log_c=log_c,
        input_end=input_end, alpha=float(alpha), pooling=pooling, redistribute=redistribute,
    )

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
from ._checks import as_index, as_row_index, check_lse, check_log_c, check_q_k, check_ranges, check_tensor
from ._dispatch import BackendUnavailable, kernel, resolve_backend
from .attention_features import attention_features
from .efficient_attention import efficient_attention

__all__ = [
    "BackendUnavailable",
    "attention_features",
    "decode_attention",
    "efficient_attention",
    "macs_pool",
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


def macs_pool(
    q, k_cache, *, input_start, input_end, kv_len, scale, pooling="max", redistribute=True, lse=None, out=None,
    backend=None,
) -> torch.Tensor:
    """MACS's head-pooled row m' of each query row, before the floor: the per-layer quantity that the tracer
    combines over layers (and, under tensor parallelism, over ranks) before taking the floor and the log.

    q: (B, H, D), one row per sequence, or (B, H, R, D), R rows per sequence (a verify pass of assisted
        decoding, packed requests).
    k_cache: (B, H_kv, S, D).
    input_start, input_end, kv_len: (B,) or (B, R) (a (B,) range applies to every row of item b). Row
        (b, r) attends keys [input_start, kv_len) of item b; [input_start, input_end) are its N inputs,
        [input_end, kv_len) generated tokens whose attention is spread evenly over the inputs when
        `redistribute`.
    lse: optional (B, H) or (B, H, R) natural-log log-sum-exp over each row's attended keys.
    out: optional float32 (B, N_max) or (B, R, N_max) buffer (q's rank minus one), written and returned.
    Returns float32 (B, N_max) or (B, R, N_max): m'[b, r, i] = pool over heads of (p[h, input_start + i] +
    the row's mass on generated keys / N) for i < N of that row, 0 after. N_max defaults to the largest N.
    """
    MacsConfig(pooling=pooling, redistribute=redistribute, backend=backend)
    check_q_k(q, k_cache, q_dims=q.dim() if isinstance(q, torch.Tensor) and q.dim() in (3, 4) else 3)
    single_row = q.dim() == 3
    block = q.unsqueeze(2) if single_row else q
    batch, heads, rows, _ = block.shape
    ranges = [
        as_row_index(name, value, batch, rows, q.device)
        for name, value in (("input_start", input_start), ("input_end", input_end), ("kv_len", kv_len))
    ]
    n_max = int((ranges[1] - ranges[0]).max()) if out is None else out.shape[-1]
    check_ranges(*(index.flatten() for index in ranges), k_cache.shape[2], n_max, state="out")
    if lse is not None:
        check_lse(lse, (batch, heads) if single_row else (batch, heads, rows), q.device)
        lse = lse.unsqueeze(-1) if single_row else lse
    expected = (batch, n_max) if single_row else (batch, rows, n_max)
    if out is None:
        out = torch.empty(expected, dtype=torch.float32, device=q.device)
    elif not isinstance(out, torch.Tensor) or tuple(out.shape) != expected or out.dtype != torch.float32 \
            or out.device != q.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {expected} on {q.device}")
    kernel(backend, q.device, "macs_pool")(
        block, k_cache, out.view(batch, rows, n_max), input_start=ranges[0], input_end=ranges[1],
        kv_len=ranges[2], scale=float(scale), pooling=pooling, redistribute=redistribute, lse=lse,
    )
    return out


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
    q, k_cache, v_cache, *, kv_start=None, kv_len, scale, log_c=None, pooled=None, input_end=None, alpha=0.8,
    pooling="max", redistribute=True, backend=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per sequence over keys [kv_start, kv_len), optionally fused with MACS.

    q: (B, H, D); k_cache, v_cache: (B, H_kv, S, D). kv_start: (B,) left pads (default 0).
    Returns out (B, H, D) in q's dtype and lse (B, H) float32 (natural log). From the same single read of K,
    with `input_end` (B,) (inputs are keys [kv_start, input_end)) and either
    - `log_c` (B, N_max): also performs macs_update, or
    - `pooled` (B, N_max) float32: also writes macs_pool's m' (the tracer floors and logs it per pass).
    """
    MacsConfig(alpha=alpha, pooling=pooling, redistribute=redistribute, backend=backend)
    check_q_k(q, k_cache, v_cache)
    batch = q.shape[0]
    kv_len = as_index("kv_len", kv_len, batch, q.device)
    kv_start = as_index("kv_start", 0 if kv_start is None else kv_start, batch, q.device)
    if log_c is not None and pooled is not None:
        raise ValueError("give log_c or pooled, not both")
    state, name = (log_c, "log_c") if pooled is None else (pooled, "pooled")
    if state is None:
        if input_end is not None:
            raise ValueError("input_end is only meaningful together with log_c or pooled")
        check_ranges(kv_start, kv_len, kv_len, k_cache.shape[2])
    else:
        if input_end is None:
            raise ValueError(f"{name} needs input_end (the end of the input keys)")
        check_log_c(state, batch, q.device, name=name)
        input_end = as_index("input_end", input_end, batch, q.device)
        check_ranges(kv_start, input_end, kv_len, k_cache.shape[2], state.shape[1], state=name)
    return kernel(backend, q.device, "decode_attention")(
        q, k_cache, v_cache, kv_start=kv_start, kv_len=kv_len, scale=float(scale), log_c=log_c, pooled=pooled,
        input_end=input_end, alpha=float(alpha), pooling=pooling, redistribute=redistribute,
    )

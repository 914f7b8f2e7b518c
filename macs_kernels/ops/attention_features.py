"""Public op attention_features: AT2's per-head attention of R target rows on a span of source keys,
summed over the rows, without ever holding more than one layer's (B, H, R, S) block."""
from __future__ import annotations

import torch

from macs_kernels.ops._checks import (
    IndexLike,
    as_index,
    as_scale,
    check_lse,
    check_q_k,
    invalid_entry,
    values_readable,
    values_to_check,
)
from macs_kernels.ops.library import define_operator
from macs_kernels.ops.registry import kernel
from macs_kernels.ops.torch import features as torch_features
from macs_kernels.ops.variant import Variant


def _fake(q, k_cache, source_start, source_end, kv_start, kv_len, n_rows, n_max, scale, lse, window=None, softcap=None,
          sinks=None):
    return q.new_empty((q.shape[0], q.shape[1], n_max), dtype=torch.float32)


operator = define_operator(torch_features.attention_features, fake=_fake)


def check_features_args(q, k_cache, source_start, source_end, kv_start, kv_len, n_rows, lse, n_max=None,
                        validate=None):
    """Validate attention_features' arguments (values where and when `validate` says: see ops._checks).

    Returns (source_start, source_end, kv_start, kv_len, n_rows) as (B,) int32 or int64 and N_max: `n_max` when given
    (every span must fit it), else the longest span (read on the host: refused inside a capture).
    """
    check_q_k(q, k_cache, q_dims=4)
    batch, heads, rows, _ = q.shape
    check_lse(lse, (batch, heads, rows), q.device)
    if n_max is not None and (isinstance(n_max, bool) or not isinstance(n_max, int) or n_max < 1):
        raise ValueError(f"n_max must be an int >= 1 or None, got {n_max!r}")
    index = {
        name: as_index(name, value, batch, q.device)
        for name, value in (
            ("source_start", source_start), ("source_end", source_end), ("kv_len", kv_len),
            ("kv_start", 0 if kv_start is None else kv_start), ("n_rows", rows if n_rows is None else n_rows),
        )
    }
    s0, s1, length, start, count = index.values()
    values = values_to_check(validate, *index.values())
    if values is not None:
        check_spans(*values, k_cache.shape[2], rows, n_max)
    if n_max is None:
        values_readable("n_max", q)
        n_max = int((s1 - s0).max())
    return s0, s1, start, length, count, n_max


def check_spans(s0, s1, length, start, count, keys, rows, n_max):
    """Every item's source span and valid rows against its attended keys (on the host or as an assertion: see
    ops._checks)."""
    spans = (0 <= start) & (start <= s0) & (s0 < s1) & (s1 <= length) & (length <= keys)
    counts = (0 <= count) & (count <= rows) & (length - count >= start)
    valid = spans & counts if n_max is None else spans & counts & (s1 - s0 <= n_max)
    spans_rule = f"0 <= kv_start <= source_start < source_end <= kv_len <= S={keys}"
    counts_rule = (f"n_rows must lie in [0, R={rows}] and the first valid row must attend a key "
                   "(kv_len - n_rows >= kv_start)")
    b = invalid_entry(valid, f"every item needs {spans_rule}; {counts_rule}"
                      + ("" if n_max is None else f"; source_end - source_start <= n_max={n_max}"))
    if b is not None:
        s0, s1, length, start, count = (int(value[b]) for value in (s0, s1, length, start, count))
        if not 0 <= start <= s0 < s1 <= length <= keys:
            raise ValueError(f"item {b}: need {spans_rule}, got kv_start={start}, source_start={s0}, "
                             f"source_end={s1}, kv_len={length}")
        if not 0 <= count <= rows or length - count < start:
            raise ValueError(f"item {b}: {counts_rule}, got n_rows={count}, kv_len={length}, kv_start={start}")
        raise ValueError(f"item {b}: its {s1 - s0} source keys do not fit n_max={n_max}")


def attention_features(
    q: torch.Tensor, k_cache: torch.Tensor, *, source_start: IndexLike, source_end: IndexLike, kv_len: IndexLike,
    scale: float, kv_start: IndexLike | None = None, n_rows: IndexLike | None = None, lse: torch.Tensor | None = None,
    backend: str | None = None, variant: Variant | None = None, n_max: int | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """Per query head, the attention of R target rows on the source keys, summed over the valid rows.

    q: (B, H, R, D) post-RoPE queries of the target rows, in order; k_cache: (B, H_kv, S, D), query head h
        reads KV head h // (H // H_kv).
    source_start, source_end, kv_len, kv_start, n_rows: (B,) (ints broadcast). Item b has n_rows[b] valid
        rows, the FIRST ones (default R); the last valid row sits at key kv_len[b] - 1, so valid row r
        (< n_rows[b]) attends keys [kv_start[b], kv_len[b] - n_rows[b] + r + 1). Rows r >= n_rows[b]
        (responses that ended earlier in a batch) are ignored, whatever q holds there.
        Need kv_start <= source_start < source_end <= kv_len.
    lse: optional (B, H, R) natural-log log-sum-exp of each row's scores q.k * scale over its attended keys
        (as FlashAttention returns it); given, the kernels read only the source keys, once.
    n_max: the output's width N_max, at least every source_end - source_start; default the largest of them, which
        reads the index values on the host (a sync on a GPU; pass n_max inside torch.compile or a CUDA graph).
    validate: check the index values (None: only where free, i.e. CPU tensors; True: always, one host sync on a
        GPU; False: never; see docs/api.md, "Argument checks").
    Returns (B, H, N_max) float32: entry [b, h, i] is the sum
    over valid rows of softmax probability on key source_start[b] + i (a key after a row's causal end gets
    0 from that row); entries i >= source_end[b] - source_start[b] are 0.
    """
    source_start, source_end, kv_start, kv_len, n_rows, n_max = check_features_args(
        q, k_cache, source_start, source_end, kv_start, kv_len, n_rows, lse, n_max, validate
    )
    extra = {}
    if variant is not None and not variant.plain:
        if lse is not None:
            raise ValueError("lse cannot be given with a variant: the kernel computes its own normaliser")
        if not isinstance(variant.key_offset, int) or variant.key_offset != 0:
            raise ValueError(f"attention_features reads the keys of every token (key_offset=0), got key_offset="
                             f"{variant.key_offset!r}: a sliding-window cache's keys do not hold the earlier rows'")
        variant.check(q.shape[1], kv_start, kv_len, k_cache.shape[2], validate)
        extra = {"window": variant.window, "softcap": variant.softcap, "sinks": variant.sinks}
    return kernel(backend, q.device, "attention_features")(
        q, k_cache, source_start, source_end, kv_start, kv_len, n_rows, n_max, as_scale(scale), lse, **extra
    )

"""decode_attention: attention of one query per sequence (flash-decoding), optionally fused with MACS."""
from __future__ import annotations

import torch

from macs_kernels.ops._checks import (
    DEFAULT_ALPHA,
    IndexLike,
    as_index,
    as_scale,
    check_log_c,
    check_options,
    check_q_k,
    check_ranges,
    zeros_index,
)
from macs_kernels.ops.library import define_operator
from macs_kernels.ops.registry import kernel
from macs_kernels.ops.torch import backend as torch_backend
from macs_kernels.ops.variant import Variant, of_arguments


def _fake(q, k_cache, v_cache, kv_start, kv_len, scale, log_c, input_end, alpha, pooling, redistribute, pooled,
          score_start=None, softcap=None, sinks=None):
    batch, heads, _ = q.shape
    return q.new_empty((batch, heads, v_cache.shape[-1])), q.new_empty((batch, heads), dtype=torch.float32)


operator = define_operator(torch_backend.decode_attention, mutates_args=("log_c", "pooled"), fake=_fake)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, kv_start: IndexLike | None = None,
    kv_len: IndexLike, scale: float, log_c: torch.Tensor | None = None, pooled: torch.Tensor | None = None,
    input_end: IndexLike | None = None, alpha: float = DEFAULT_ALPHA, pooling: str = "max", redistribute: bool = True,
    backend: str | None = None, window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None, key_offset: int = 0, variant: Variant | None = None,
    validate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per sequence over keys [kv_start, kv_len), optionally fused with MACS.

    q: (B, H, D); k_cache: (B, H_kv, S, D); v_cache: (B, H_kv, S, D_v). kv_start: (B,) left pads (default 0).
    Returns out (B, H, D_v) in q's dtype and lse (B, H) float32 (natural log). From the same single read of K,
    with `input_end` (B,) (inputs are keys [kv_start, input_end)) and either
    - `log_c` (B, N_max): also performs macs_update, or
    - `pooled` (B, N_max) float32: also writes macs_pool's m' (the tracer floors and logs it per pass).
    window, softcap, sinks, key_offset: the layer's attention variant, optional arguments as in ops.macs_pool
    (torch, triton and cuda backends; not with log_c): positions are then tokens, the output and lse are the
    variant's (sink mass attends no value). variant: the same four as one `ops.Variant`; not with them.
    validate: check the index values (None: only where free, i.e. CPU tensors; True: always, one host sync on a
        GPU; False: never; see docs/api.md, "Argument checks").
    """
    variant = of_arguments(variant, window, key_offset, softcap, sinks)
    check_options(alpha=alpha, pooling=pooling, redistribute=redistribute, backend=backend)
    check_q_k(q, k_cache, v_cache)
    batch = q.shape[0]
    kv_len = as_index("kv_len", kv_len, batch, q.device)
    kv_start = (zeros_index(batch, q.device, kv_len.dtype) if kv_start is None
                else as_index("kv_start", kv_start, batch, q.device))
    if log_c is not None and pooled is not None:
        raise ValueError("give log_c or pooled, not both")
    keys = k_cache.shape[2]
    varied = not variant.plain
    if varied:
        if log_c is not None:
            raise ValueError("decode_attention with a variant writes pooled rows, not log_c")
        keys = variant.check(q.shape[1], kv_start, kv_len, keys, validate)
    state, name = (log_c, "log_c") if pooled is None else (pooled, "pooled")
    if state is None:
        if input_end is not None:
            raise ValueError("input_end is only meaningful together with log_c or pooled")
        check_ranges(kv_start, kv_len, kv_len, keys, validate=validate)
    else:
        if input_end is None:
            raise ValueError(f"{name} needs input_end (the end of the input keys)")
        check_log_c(state, batch, q.device, name=name)
        input_end = as_index("input_end", input_end, batch, q.device)
        check_ranges(kv_start, input_end, kv_len, keys, state.shape[1], state=name, validate=validate)
    run = kernel(backend, q.device, "decode_attention", variant if varied else None)
    extra = {}
    if varied:  # token positions -> key slots; the kernel takes the variant's arguments
        (kv_start, end, kv_len), extra = variant.key_slots(kv_start, kv_len if input_end is None else input_end,
                                                           kv_len, scored=pooled is not None)
        input_end = None if pooled is None else end
    return run(q, k_cache, v_cache, kv_start, kv_len, as_scale(scale), log_c, input_end, float(alpha), pooling,
               bool(redistribute), pooled, **extra)

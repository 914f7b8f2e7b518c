"""macs_update: one layer's MACS term added to the log consistency state, in place, from q and the keys."""
from __future__ import annotations

import torch

from macs_kernels.ops._checks import (
    DEFAULT_ALPHA,
    IndexLike,
    as_index,
    as_scale,
    check_log_c,
    check_lse,
    check_options,
    check_q_k,
    check_ranges,
)
from macs_kernels.ops.library import define_operator
from macs_kernels.ops.registry import kernel
from macs_kernels.ops.torch import backend as torch_backend

# Schema from torch_backend.macs_update's type hints; the torch path is the kernel on every device unless
# the compiled extension registers its CUDA kernel. Mutating and returning nothing, the op's fake kernel is
operator = define_operator(torch_backend.macs_update, mutates_args=("log_c",))


def macs_update(
    q: torch.Tensor, k_cache: torch.Tensor, log_c: torch.Tensor, *, input_start: IndexLike, input_end: IndexLike,
    kv_len: IndexLike, scale: float, alpha: float = DEFAULT_ALPHA, pooling: str = "max", redistribute: bool = True,
    lse: torch.Tensor | None = None, backend: str | None = None, validate: bool | None = None,
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
    validate: check the index values (None: only where free, i.e. CPU tensors; True: always, one host sync on a
        GPU; False: never; see docs/api.md, "Argument checks").
    """
    check_options(alpha=alpha, pooling=pooling, redistribute=redistribute, backend=backend)
    check_q_k(q, k_cache)
    batch, heads, _ = q.shape
    check_log_c(log_c, batch, q.device)
    check_lse(lse, (batch, heads), q.device)
    input_start, input_end, kv_len = (
        as_index(name, value, batch, q.device)
        for name, value in (("input_start", input_start), ("input_end", input_end), ("kv_len", kv_len))
    )
    check_ranges(input_start, input_end, kv_len, k_cache.shape[2], log_c.shape[1], validate=validate)
    kernel(backend, q.device, "macs_update")(
        q, k_cache, log_c, input_start, input_end, kv_len, as_scale(scale), float(alpha), pooling, bool(redistribute),
        lse,
    )

"""The ops: one module per op (argument checks, the `torch.ops.macs_kernels` operator declaration, backend
dispatch, a docstring with shapes); this package only re-exports them.

Conventions shared by every op:
- (B,) index tensors are int32 or int64, read as they are (no conversion launched; Python ints and sequences
  are accepted too, at the cost of a fill or a copy from the host); key positions are
  absolute slots of the cache, so with left padding `kv_len` = pads + tokens in use;
- query head h reads KV head h // (H // H_kv) (grouped-query attention);
- any float dtype in, float32 accumulation; the last dimension must have unit stride;
- `backend`: "torch", "triton", "cuda", or None for the best available on the tensors' device that passes
  its self-check there (never the Triton interpreter); a backend named but unavailable raises
  `BackendUnavailable`.

No op makes the host wait for the device or launches a kernel to check its arguments (issues 42, 48): shapes,
dtypes and devices are checked on the host; index values on the host for CPU tensors (a ValueError naming the row;
an assertion inside torch.compile), on a device only with `validate=True` or MACS_KERNELS_VALIDATE=1 (see _checks).
So each op compiles under torch.compile(fullgraph=True) and can be captured in a CUDA graph;
there, give the outputs whose width depends on index values (`out` of macs_pool and macs_pool_paged,
attention_features' `n_max`).
The exception: efficient_attention on a GPU reads its Cholesky fallback's test and eigh's error code on the host.
"""
from macs_kernels.ops._checks import BACKENDS, POOLINGS
from macs_kernels.ops.attention_features import attention_features
from macs_kernels.ops.decode_attention import decode_attention
from macs_kernels.ops.efficient_attention import efficient_attention
from macs_kernels.ops.macs_pool import macs_pool
from macs_kernels.ops.macs_pool_paged import macs_pool_paged
from macs_kernels.ops.macs_update import macs_update
from macs_kernels.ops.macs_update_rows import macs_update_rows
from macs_kernels.ops.macs_zscore import macs_zscore
from macs_kernels.ops.registry import (
    BackendUnavailable,
    implementation,
    resolve_backend,
    self_check,
    verified_backend,
    why_unavailable,
)
from macs_kernels.ops.variant import Variant

__all__ = [
    "BACKENDS",
    "POOLINGS",
    "BackendUnavailable",
    "Variant",
    "attention_features",
    "decode_attention",
    "efficient_attention",
    "implementation",
    "macs_pool",
    "macs_pool_paged",
    "macs_update",
    "macs_update_rows",
    "macs_zscore",
    "resolve_backend",
    "self_check",
    "verified_backend",
    "why_unavailable",
]

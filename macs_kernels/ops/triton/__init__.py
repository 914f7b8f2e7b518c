"""Triton backend of the ops (GPU, or the interpreter with TRITON_INTERPRET=1).

Each launcher takes the validated positional arguments of its operator (see ops/<op>.py).
LAUNCHES counts launches per kernel name (`uncounted()` leaves the self-check's out).
"""
from macs_kernels.ops.triton.attention_features import attention_features
from macs_kernels.ops.triton.common import LAUNCHES, uncounted
from macs_kernels.ops.triton.decode_attention import decode_attention
from macs_kernels.ops.triton.efficient_attention import efficient_attention
from macs_kernels.ops.triton.macs_pool import macs_pool
from macs_kernels.ops.triton.macs_pool_paged import macs_pool_paged
from macs_kernels.ops.triton.macs_update import macs_update
from macs_kernels.ops.triton.macs_update_rows import macs_update_rows
from macs_kernels.ops.triton.macs_zscore import macs_zscore

__all__ = [
    "LAUNCHES", "attention_features", "decode_attention", "efficient_attention",
    "macs_pool", "macs_pool_paged", "macs_update", "macs_update_rows", "macs_zscore", "uncounted",
]

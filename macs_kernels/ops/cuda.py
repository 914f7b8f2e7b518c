"""CUDA backend: the kernels of csrc/, compiled into macs_kernels._C, called through torch.ops.macs_kernels.

Importing this module fails with ImportError when the extension was not built; ops/_dispatch.py reports
the backend as unavailable then. Arguments arrive validated (see ops/__init__.py).
"""
from __future__ import annotations

import torch

from . import library  # noqa: F401 - defines the operators whose CUDA kernels the extension registers

try:
    from .. import _C  # noqa: F401 - registers the CUDA kernels
except ImportError as error:
    raise ImportError(
        "macs_kernels._C is not built: install on a machine with CUDA torch and nvcc "
        "(pip install --no-build-isolation -e ., without MACS_KERNELS_SKIP_CUDA_BUILD=1) "
        f"to get the cuda backend ({error})"
    ) from error

_ops = torch.ops.macs_kernels


def macs_update(q, k_cache, log_c, *, input_start, input_end, kv_len, scale, alpha, pooling, redistribute, lse):
    _ops.macs_update(q, k_cache, log_c, input_start, input_end, kv_len, scale, alpha, pooling, redistribute, lse)


def macs_update_rows(rows, log_c, *, input_start, input_end, kv_len, alpha, pooling, redistribute):
    _ops.macs_update_rows(rows, log_c, input_start, input_end, kv_len, alpha, pooling, redistribute)


def macs_zscore(log_c, n_input):
    return _ops.macs_zscore(log_c, n_input)


def decode_attention(
    q, k_cache, v_cache, *, kv_start, kv_len, scale, log_c, input_end, alpha, pooling, redistribute, pooled=None
):
    if pooled is not None:
        raise NotImplementedError("the cuda decode kernel has no pooled mode yet; use backend='torch'")
    return _ops.decode_attention(
        q, k_cache, v_cache, kv_start, kv_len, scale, log_c, input_end, alpha, pooling, redistribute
    )


def attention_features(q, k_cache, *, source_start, source_end, kv_start, kv_len, n_rows, n_max, scale, lse):
    return _ops.attention_features(q, k_cache, source_start, source_end, kv_start, kv_len, n_rows, n_max, scale, lse)

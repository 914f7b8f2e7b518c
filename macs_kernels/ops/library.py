"""The ops as PyTorch operators `torch.ops.macs_kernels.*`: schemas, the torch path as their CPU kernel,
and fake kernels for torch.compile.

The compiled extension macs_kernels._C registers the CUDA kernels of these same operators (csrc/bindings.cpp);
this module needs no extension, so the operators exist (and opcheck runs) on any machine. Arguments are
positional in the schemas, in the order of the keyword signatures of torch_backend.py; index tensors are
(B,) int64 as the public ops pass them.
"""
from __future__ import annotations

import torch

from . import torch_backend

NAMESPACE = "macs_kernels"

SCHEMAS = {
    "macs_update": (
        "(Tensor q, Tensor k_cache, Tensor(a!) log_c, Tensor input_start, Tensor input_end, Tensor kv_len, "
        "float scale, float alpha, str pooling, bool redistribute, Tensor? lse) -> ()"
    ),
    "macs_update_rows": (
        "(Tensor rows, Tensor(a!) log_c, Tensor input_start, Tensor input_end, Tensor kv_len, "
        "float alpha, str pooling, bool redistribute) -> ()"
    ),
    "macs_zscore": "(Tensor log_c, Tensor n_input) -> Tensor",
    "decode_attention": (
        "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_start, Tensor kv_len, float scale, "
        "Tensor(a!)? log_c, Tensor? input_end, float alpha, str pooling, bool redistribute) -> (Tensor, Tensor)"
    ),
    "attention_features": (
        "(Tensor q, Tensor k_cache, Tensor source_start, Tensor source_end, Tensor kv_start, Tensor kv_len, "
        "Tensor n_rows, int n_max, float scale, Tensor? lse) -> Tensor"
    ),
}

_library = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    _library.define(_name + _schema)


def _cpu_macs_update(q, k_cache, log_c, input_start, input_end, kv_len, scale, alpha, pooling, redistribute, lse):
    torch_backend.macs_update(
        q, k_cache, log_c, input_start=input_start, input_end=input_end, kv_len=kv_len, scale=scale,
        alpha=alpha, pooling=pooling, redistribute=redistribute, lse=lse,
    )


def _cpu_macs_update_rows(rows, log_c, input_start, input_end, kv_len, alpha, pooling, redistribute):
    torch_backend.macs_update_rows(
        rows, log_c, input_start=input_start, input_end=input_end, kv_len=kv_len,
        alpha=alpha, pooling=pooling, redistribute=redistribute,
    )


def _cpu_decode_attention(q, k_cache, v_cache, kv_start, kv_len, scale, log_c, input_end, alpha, pooling, redistribute):
    return torch_backend.decode_attention(
        q, k_cache, v_cache, kv_start=kv_start, kv_len=kv_len, scale=scale, log_c=log_c, input_end=input_end,
        alpha=alpha, pooling=pooling, redistribute=redistribute,
    )


_library.impl("macs_update", _cpu_macs_update, "CPU")
_library.impl("macs_update_rows", _cpu_macs_update_rows, "CPU")
_library.impl("macs_zscore", torch_backend.macs_zscore, "CPU")
_library.impl("decode_attention", _cpu_decode_attention, "CPU")


def _cpu_attention_features(q, k_cache, source_start, source_end, kv_start, kv_len, n_rows, n_max, scale, lse):
    return torch_backend.attention_features(
        q, k_cache, source_start=source_start, source_end=source_end, kv_start=kv_start, kv_len=kv_len,
        n_rows=n_rows, n_max=n_max, scale=scale, lse=lse,
    )


_library.impl("attention_features", _cpu_attention_features, "CPU")


@torch.library.register_fake(f"{NAMESPACE}::macs_update", lib=_library)
def _fake_macs_update(q, k_cache, log_c, input_start, input_end, kv_len, scale, alpha, pooling, redistribute, lse):
    return None


@torch.library.register_fake(f"{NAMESPACE}::macs_update_rows", lib=_library)
def _fake_macs_update_rows(rows, log_c, input_start, input_end, kv_len, alpha, pooling, redistribute):
    return None


@torch.library.register_fake(f"{NAMESPACE}::macs_zscore", lib=_library)
def _fake_macs_zscore(log_c, n_input):
    return torch.empty_like(log_c, memory_format=torch.contiguous_format)


@torch.library.register_fake(f"{NAMESPACE}::decode_attention", lib=_library)
def _fake_decode_attention(q, k_cache, v_cache, kv_start, kv_len, scale, log_c, input_end, alpha, pooling, redistribute):
    batch, heads, _ = q.shape
    out = q.new_empty((batch, heads, v_cache.shape[-1]))
    lse = q.new_empty((batch, heads), dtype=torch.float32)
    return out, lse


@torch.library.register_fake(f"{NAMESPACE}::attention_features", lib=_library)
def _fake_attention_features(q, k_cache, source_start, source_end, kv_start, kv_len, n_rows, n_max, scale, lse):
    return q.new_empty((q.shape[0], q.shape[1], n_max), dtype=torch.float32)

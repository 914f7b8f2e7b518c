"""Backend choice: cuda > triton > torch by what the tensors' device supports.

Optional backends are imported only here and only when asked for, so `import macs_kernels` needs
neither triton nor the compiled extension.
"""
from __future__ import annotations

import functools
import importlib
import os

import torch

from ..config import BACKENDS


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


def why_unavailable(backend: str, device: torch.device) -> str | None:
    """None when `backend` can run on `device`, else the reason in words."""
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
        error = _import_error("macs_kernels.ops.cuda")
        return None if error is None else f"the compiled extension macs_kernels._C is absent ({error})"
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or None")


_MODULES = {
    "torch": "macs_kernels.ops.torch_backend",
    "triton": "macs_kernels.ops.triton",
    "cuda": "macs_kernels.ops.cuda",
}


def _has_op(backend: str, op: str | None) -> bool:
    return op is None or hasattr(importlib.import_module(_MODULES[backend]), op)


def resolve_backend(backend: str | None, device: torch.device, op: str | None = None) -> str:
    """The backend to run `op` on `device`: the named one (raising if it cannot run) or the best available.

    Automatic choice never picks the Triton interpreter (it is for tests, and thousands of times slower),
    and skips backends that have no kernel for `op`.
    """
    device = torch.device(device)
    if backend is not None:
        reason = why_unavailable(backend, device)
        if reason is None and not _has_op(backend, op):
            reason = f"it has no {op} kernel"
        if reason is not None:
            raise BackendUnavailable(f"backend {backend!r} is unavailable: {reason}")
        return backend
    if device.type == "cuda":
        for candidate in ("cuda", "triton"):
            if why_unavailable(candidate, device) is None and _has_op(candidate, op):
                return candidate
    return "torch"


def implementation(backend: str, op: str):
    """The function that computes `op` on `backend` (arguments already validated)."""
    function = getattr(importlib.import_module(_MODULES[backend]), op, None)
    if function is None:
        raise BackendUnavailable(f"backend {backend!r} has no {op} kernel")
    return function


def kernel(backend: str | None, device: torch.device, op: str):
    """implementation(resolve_backend(backend, device, op), op): the kernel that runs `op` here."""
    return implementation(resolve_backend(backend, device, op), op)

"""The cuda backend's Python side: its kernels are the compiled extension macs_kernels._C's (csrc/), registered
for the operators `torch.ops.macs_kernels.<op>`; here its settings.

The split kernels (csrc/split_kv_choice.h): "pipelined" (csrc/split_kv_pipelined), the default, exact on an H200
and 1.5-2.0x faster than "verified" (csrc/split_kv, the first to pass the GPU tests and compute-sanitizer, which
runs the shapes "pipelined" does not cover); "mma" (csrc/split_kv_mma, tensor cores, not yet run on a GPU) is
selectable. Chosen for the process by MACS_KERNELS_CUDA_SPLIT_KV (read by the extension at its first split-KV
launch) or by set_cuda_split_kv_kernel.
Importing this package loads no extension.
"""
from __future__ import annotations

import importlib

from macs_kernels.ops.backends import BackendUnavailable, declared

CUDA_SPLIT_KV_KERNELS = ("verified", "pipelined", "mma")
CUDA_SPLIT_KV_DEFAULT = "pipelined"


def _extension():
    spec = declared("cuda")
    try:
        module = importlib.import_module(spec.requires)
    except Exception as error:  # noqa: BLE001 - any failure means the extension is absent
        raise BackendUnavailable(spec.missing.format(error=f"{type(error).__name__}: {error}")) from None
    return getattr(module, "library", module)  # the emulation's module holds its library


def cuda_split_kv_kernel() -> str:
    """The split kernel that the cuda backend's decode_attention, macs_update and macs_pool(_paged) launch."""
    return _extension().split_kv_kernel()


def set_cuda_split_kv_kernel(kernel: str) -> None:
    """Launch `kernel` (one of CUDA_SPLIT_KV_KERNELS) from now on in this process; shapes that "pipelined" does
    not cover (K/V rows not 16-byte aligned, D not a power-of-two multiple of 16 bytes up to 512 bytes, D_v != D,
    (H / H_kv) * D / 16 bytes > 256) run "verified"; shapes that "mma" does not cover (fp32, D not 64 or 128,
    D_v != D, H / H_kv > 16) run what "pipelined" runs. A CUDA graph keeps the kernel it captured."""
    if kernel not in CUDA_SPLIT_KV_KERNELS:
        raise ValueError(f"unknown cuda split kernel {kernel!r}; choose one of {CUDA_SPLIT_KV_KERNELS}")
    _extension().set_split_kv_kernel(kernel)

"""The cuda backend's Python side: its kernels are the compiled extension macs_kernels._C's (csrc/), registered
for the operators `torch.ops.macs_kernels.<op>`; `emulation` runs the same sources on the CPU.

The split-KV ops (decode_attention, macs_update, macs_pool, macs_pool_paged) launch one of three first passes,
chosen by shape (SplitKernel in csrc/split_kv/policy.cuh), the fastest that takes it and whose block fits the GPU's
shared memory: the tensor-core kernel (csrc/split_kv_mma) for fp16/bf16 inputs with D 64 or 128, D_v == D,
H / H_kv <= 16 and 16-byte aligned K/V rows on sm_80 and later (on GPUs with 99 KB a block, decode_attention at
D 128 runs the next); else the pipelined kernel (csrc/split_kv_pipelined) for 16-byte aligned rows of D / 16 bytes
a power of two up to 32, D_v == D and (H / H_kv) * D / 16 bytes <= 256 (float32 among them); else split_kernel
(csrc/split_kv) for the other shapes the ops accept.
Importing this package loads no extension.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools


@functools.cache
def _library() -> ctypes.CDLL:
    """The extension's library (or, with MACS_KERNELS_CUDA_EMULATION=1, its CPU build's), for its C functions."""
    from macs_kernels.ops.backends import cuda_emulated

    if cuda_emulated():
        from macs_kernels.ops.cuda import emulation

        library = emulation._runtime
    else:
        from macs_kernels import _C

        library = ctypes.CDLL(_C.__file__)
    library.macs_kernels_dependent_launches_made.restype = ctypes.c_longlong
    return library


@contextlib.contextmanager
def dependent_launches(enabled: bool = True):
    """Split passes inside launch their combine and head pooling as programmatic dependents of the kernel before
    them (`enabled`), or not: what MACS_KERNELS_CUDA_PDL=1 sets (csrc/common.cuh, launch_kernel; sm_90 and later,
    kernels compiled for compute_90 or later; off by default until a GPU times it). The switch is the process's: other
    threads' launches meanwhile follow it too. Loads the extension (or its CPU build, whose launch log records each
    launch's `dependent`)."""
    set_dependent = _library().macs_kernels_set_dependent_launches
    previous = set_dependent(int(enabled))
    try:
        yield
    finally:
        set_dependent(previous)


def dependent_launches_made() -> int:
    """Launches made as programmatic dependents since the extension loaded (0 in the CPU build, which records them in
    its launch log)."""
    return _library().macs_kernels_dependent_launches_made()

"""The `vllm.general_plugins` entry point (`macs_kernels = macs_kernels.vllm.plugin:register`)."""
from __future__ import annotations

import functools
import sys

BACKEND = "macs_kernels.vllm.backend.MacsCPUAttentionBackend"
# A module whose attribute `lib` answers every attribute name, `__dict__` with a function: vLLM's scan below
# cannot read it.
_UNSCANNABLE = "llvmlite.binding.ffi"


def register() -> None:
    """Put the MACS-aware CPU attention backend in CPU_ATTN's place. vLLM calls this in its front end, its
    engine core and every worker, before any engine picks (and caches) its attention backend. On CPUs the
    platform always answers CPU_ATTN, whatever the CUSTOM slot holds, so the override replaces that entry.
    Other platforms are left as they are: their backends are not wrapped yet."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
        _scan_past_llvmlite()


def _scan_past_llvmlite() -> None:
    """vLLM 0.32's CPU platform rebinds its Triton kernel overrides at every engine start by reading
    `vars(value)` of every attribute of every loaded module (triton_utils/dispatcher._rebind_kernels); once a
    process has imported numba (the paged op's CPU kernel; vLLM's own n-gram proposer too), llvmlite's
    `ffi.lib` fails that scan and the next engine in the process cannot start. The scan runs with that one
    module out of sys.modules (it holds no kernel)."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    scan = getattr(dispatcher, "_rebind_kernels", None)
    if scan is None or getattr(scan, "macs_kernels_guard", False):
        return

    @functools.wraps(scan)
    def guarded(overrides):
        hidden = sys.modules.pop(_UNSCANNABLE, None)
        try:
            return scan(overrides)
        finally:
            if hidden is not None:
                sys.modules[_UNSCANNABLE] = hidden

    guarded.macs_kernels_guard = True
    dispatcher._rebind_kernels = guarded

"""The `vllm.general_plugins` entry point (`macs_kernels = macs_kernels.vllm.plugin:register`)."""
from __future__ import annotations

import functools
import sys

# The MACS-aware backend that takes each wrapped vLLM backend's place, by vLLM's backend name.
BACKENDS = {
    "CPU_ATTN": "macs_kernels.engines.vllm.backend.MacsCPUAttentionBackend",
    "FLASH_ATTN": "macs_kernels.engines.vllm.flash.MacsFlashAttentionBackend",
}
# A module whose attribute `lib` answers every attribute name, `__dict__` with a function: vLLM's scan below
# cannot read it.
_UNSCANNABLE = "llvmlite.binding.ffi"


def wrapped_backend(platform) -> str | None:
    """The name of the vLLM backend a platform's attention runs on and that macs_kernels wraps: CPU_ATTN on CPUs
    (the platform answers it whatever the CUSTOM slot holds), FLASH_ATTN on CUDA GPUs; None elsewhere."""
    if platform.is_cpu():
        return "CPU_ATTN"
    if platform.is_cuda():
        return "FLASH_ATTN"
    return None


def register() -> None:
    """Put the MACS-aware backend in the place of the one the platform runs (`wrapped_backend`), under the same
    name. vLLM calls this in its front end, its engine core and every worker, before any engine picks (and
    caches) its attention backend. Other platforms are left as they are."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    name = wrapped_backend(current_platform)
    if name is None:
        return
    register_backend(AttentionBackendEnum[name], BACKENDS[name])
    if name == "CPU_ATTN":
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

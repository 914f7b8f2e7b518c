"""The `vllm.general_plugins` entry point (`macs_kernels = macs_kernels.vllm.plugin:register`)."""
from __future__ import annotations

BACKEND = "macs_kernels.vllm.backend.MacsCPUAttentionBackend"


def register() -> None:
    """Put the MACS-aware CPU attention backend in CPU_ATTN's place. vLLM calls this in its front end, its
    engine core and every worker, before any engine picks (and caches) its attention backend. On CPUs the
    platform always answers CPU_ATTN, whatever the CUSTOM slot holds, so the override replaces that entry.
    Other platforms are left as they are: their backends are not wrapped yet."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)

"""vLLM's CPU attention backend with MACS rows: the same backend (its name stays CPU_ATTN, its metadata
builder and cache layout are vLLM's), whose forward runs vLLM's own attention, output untouched, then hands
the layer to the worker's tracer when one is attached."""
from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from . import tracer as tracing


class MacsCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        tracer = tracing.ACTIVE
        if tracer is not None and attn_metadata is not None:
            tracer.layer(self, layer, query, kv_cache, attn_metadata)
        return result


class MacsCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[MacsCPUAttentionImpl]:
        return MacsCPUAttentionImpl

"""vLLM attention backends with MACS rows: each is vLLM's own backend (its name, metadata builder and cache
layout stay vLLM's) whose forward runs vLLM's attention, output untouched, then hands the layer to the worker's
tracer when one is attached. The backends differ only in where a layer's keys lie in its KV cache
(`macs_key_pages`): CPU_ATTN's blocks are packed per ISA (probed once per layout), FLASH_ATTN's are plain
(`macs_kernels.engines.vllm.flash`)."""
from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from macs_kernels.engines.vllm import graphs
from macs_kernels.engines.vllm import tracer as tracing


class MacsAttention:
    """The forward every MACS backend shares; a subclass says where its cache keeps the keys."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Inside vLLM's load_model, under its current config: the buffers of an engine with CUDA graphs are
        # allocated where vLLM's memory profile counts them, before it sizes the KV cache.
        graphs.reserve(get_current_vllm_config())

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        if attn_metadata is None:  # vLLM's profiling run: no cache yet
            return result
        if graphs.ACTIVE is not None:  # CUDA graphs: every step, captured or not, reads the persistent plan
            graphs.ACTIVE.layer(self, layer, query, kv_cache)
            return result
        tracer = tracing.ACTIVE
        if tracer is not None:
            tracer.layer(self, layer, query, kv_cache, attn_metadata)
        return result

    def macs_key_pages(self, layer, kv_cache: torch.Tensor) -> torch.Tensor:
        """This layer's keys as (num_blocks, block_size, H_kv, D), a view of `kv_cache`."""
        raise NotImplementedError


class MacsMetadataBuilder:
    """The metadata builder every MACS backend shares: vLLM's own, which in an engine whose attention runs in CUDA
    graphs (and that has the worker extension) also writes each step's row plan into the persistent buffers the
    captured kernels read, after vLLM's metadata and outside the graphs (`macs_kernels.engines.vllm.graphs`)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        graphs.prepare(vllm_config, layer_names)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if graphs.ACTIVE is not None:
            graphs.ACTIVE.plan(tracing.ACTIVE, common_attn_metadata)
        return metadata


class MacsCPUAttentionMetadataBuilder(MacsMetadataBuilder, CPUAttentionMetadataBuilder):
    pass


class MacsCPUAttentionImpl(MacsAttention, CPUAttentionBackendImpl):
    _transposed: dict = {}  # (ISA, dtype, block size, head size) -> whether key blocks are stored [D, block]

    def macs_key_pages(self, layer, kv_cache):
        layout = (layer.isa, kv_cache.dtype, kv_cache.shape[2], self.head_size)
        if layout not in self._transposed:
            self._transposed[layout] = tracing.probe_layout(*layout)
        return tracing.key_pages(kv_cache, self._transposed[layout])


class MacsCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[MacsCPUAttentionImpl]:
        return MacsCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MacsCPUAttentionMetadataBuilder]:
        return MacsCPUAttentionMetadataBuilder

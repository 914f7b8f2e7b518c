"""vLLM's FLASH_ATTN backend (GPUs) with MACS rows: the same wrapper as CPU_ATTN's, on FlashAttention's cache.

vLLM 0.32 hands each FLASH_ATTN layer a cache of logical shape (num_blocks, H_kv, block_size, 2 * D): per
slot its key then its value on the last axis, the axes' physical order set by the KV-cache layout
(v1/kv_cache_layout.py; FlashAttention reads `kv_cache.transpose(1, 2).split(D, dim=-1)`). Its keys are
therefore already the paged op's (P, page_size, H_kv, D) at unit stride in D, whatever the physical order
(`tracer.flash_key_pages`): the Triton or CUDA paged op reads them in place.

With CUDA graphs on (vLLM's default), the metadata builder plans each step's rows into persistent buffers where
vLLM builds the step's metadata, outside the graphs, and the layers' kernels read only those buffers
(`macs_kernels.engines.vllm.graphs`); eagerly (`enforce_eager=True`) the tracer plans at the first layer.
"""
from __future__ import annotations

import vllm.model_executor.layers.attention  # noqa: F401 - the flash backend module imports it circularly
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from macs_kernels.engines.vllm.backend import MacsAttention, MacsMetadataBuilder
from macs_kernels.engines.vllm.tracer import flash_key_pages


class MacsFlashAttentionImpl(MacsAttention, FlashAttentionImpl):
    def macs_key_pages(self, layer, kv_cache):
        return flash_key_pages(kv_cache, self.head_size)


class MacsFlashAttentionMetadataBuilder(MacsMetadataBuilder, FlashAttentionMetadataBuilder):
    pass


class MacsFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[MacsFlashAttentionImpl]:
        return MacsFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MacsFlashAttentionMetadataBuilder]:
        return MacsFlashAttentionMetadataBuilder

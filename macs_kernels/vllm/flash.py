"""vLLM's FLASH_ATTN backend (GPUs) with MACS rows: the same wrapper as CPU_ATTN's, on FlashAttention's cache.

vLLM 0.32 hands each FLASH_ATTN layer a cache of logical shape (num_blocks, H_kv, block_size, 2 * D): per
slot its key then its value on the last axis, the axes' physical order set by the KV-cache layout
(v1/kv_cache_layout.py; FlashAttention reads `kv_cache.transpose(1, 2).split(D, dim=-1)`). Its keys are
therefore already the paged op's (P, page_size, H_kv, D) at unit stride in D, whatever the physical order
(`tracer.flash_key_pages`): the Triton or CUDA paged op reads them in place. Runs eagerly only (full CUDA
graphs capture attention; the tracer plans rows on the host).
"""
from __future__ import annotations

import vllm.model_executor.layers.attention  # noqa: F401 - the flash backend module imports it circularly
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from .backend import MacsAttention
from .tracer import flash_key_pages


class MacsFlashAttentionImpl(MacsAttention, FlashAttentionImpl):
    def macs_key_pages(self, layer, kv_cache):
        return flash_key_pages(kv_cache, self.head_size)


class MacsFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[MacsFlashAttentionImpl]:
        return MacsFlashAttentionImpl

"""macs_pool_paged: macs_pool over a paged KV cache read through a block table, as serving engines keep it
(transformers' continuous batching, vLLM, FlashInfer, flash_attn_with_kvcache's `block_table`). The public call is
ops.macs_pool with `block_table=`; this module declares the operator whose kernels read the pages in place."""
from __future__ import annotations

import torch

from macs_kernels.ops._checks import IndexLike
from macs_kernels.ops.library import define_operator
from macs_kernels.ops.macs_pool import macs_pool
from macs_kernels.ops.torch import backend as torch_backend
from macs_kernels.ops.variant import Variant

operator = define_operator(torch_backend.macs_pool_paged, mutates_args=("out",))


def macs_pool_paged(
    q: torch.Tensor, k_pages: torch.Tensor, block_table: torch.Tensor, *, input_start: IndexLike,
    input_end: IndexLike, kv_len: IndexLike, scale: float, pooling: str = "max", redistribute: bool = True,
    lse: torch.Tensor | None = None, out: torch.Tensor | None = None, backend: str | None = None,
    window: int | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None,
    variant: Variant | None = None, validate: bool | None = None,
) -> torch.Tensor:
    """ops.macs_pool(q, k_pages, block_table=block_table, ...): MACS's head-pooled row m' of each query row, before
    the floor, with the keys in pages. Kept as the paged op's own name (serving engines' code, the vLLM engine).

    q: (B, H, D) or (B, H, R, D), R rows per sequence.
    k_pages: (P, page_size, H_kv, D), the layout of flash_attn_with_kvcache's paged cache and of
        transformers' PagedAttentionCache page views (any strides but a unit last one).
    block_table: (B, pages) int32 or int64: key j of item b lies in page block_table[b, j // page_size] at
        slot j % page_size. Entries past an item's last attended page are never read (-1 is fine there).
    input_start, input_end, kv_len, lse, out, pooling, redistribute: as in ops.macs_pool, with keys numbered
        0 .. pages * page_size - 1 per item.
    window: a sliding-window layer's window: each row attends only keys [max(input_start, kv_len - window),
        kv_len) (the pages before are never read; the engine may have freed them), inputs before that get 0.
    sinks: (H,) per-head sink logits in the softmax's denominator only (gpt-oss): a row's probabilities over
        its keys sum to less than 1 (not with lse).
    softcap: logits capped to softcap * tanh(s / softcap) before the softmax (Gemma 2's
        attn_logit_softcapping; lse, if given, over the capped logits).
    variant: the three as one ops.Variant (its key_offset 0); not with them.
    validate: check the index values (ranges, and the table's pages in use) or not: see ops.macs_pool.
    Returns float32 (B, N_max) or (B, R, N_max), equal to ops.macs_pool on the item's keys laid out
    contiguously.
    """
    return macs_pool(q, k_pages, block_table=block_table, input_start=input_start, input_end=input_end,
                     kv_len=kv_len, scale=scale, pooling=pooling, redistribute=redistribute, lse=lse, out=out,
                     backend=backend, window=window, sinks=sinks, softcap=softcap, variant=variant,
                     validate=validate)

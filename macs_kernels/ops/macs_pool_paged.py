"""macs_pool_paged: macs_pool over a paged KV cache read through a block table, as serving engines keep it
(transformers' continuous batching, vLLM, FlashInfer, flash_attn_with_kvcache's `block_table`)."""
from __future__ import annotations

import torch

from ..config import MacsConfig
from . import torch_backend
from ._checks import IndexLike, as_scale, check_paged, check_pages_in_use
from ._dispatch import NAMESPACE, kernel, resolve_backend
from .macs_pool import row_arguments

# Writes `out` and returns nothing: the trivial fake kernel torch.library generates is the right one.
operator = torch.library.custom_op(
    f"{NAMESPACE}::macs_pool_paged", torch_backend.macs_pool_paged, mutates_args=("out",)
)


def macs_pool_paged(
    q: torch.Tensor, k_pages: torch.Tensor, block_table: torch.Tensor, *, input_start: IndexLike,
    input_end: IndexLike, kv_len: IndexLike, scale: float, pooling: str = "max", redistribute: bool = True,
    lse: torch.Tensor | None = None, out: torch.Tensor | None = None, backend: str | None = None,
    window: int | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """ops.macs_pool with the keys in pages: MACS's head-pooled row m' of each query row, before the floor.

    q: (B, H, D) or (B, H, R, D), R rows per sequence.
    k_pages: (P, page_size, H_kv, D), the layout of flash_attn_with_kvcache's paged cache and of
        transformers' PagedAttentionCache page views (any strides but a unit last one).
    block_table: (B, pages) int32 or int64: key j of item b lies in page block_table[b, j // page_size] at
        slot j % page_size. Entries past an item's last attended page are never read (-1 is fine there).
    input_start, input_end, kv_len, lse, out, pooling, redistribute: as in ops.macs_pool, with keys numbered
        0 .. pages * page_size - 1 per item.
    window: a sliding-window layer's window: each row attends only keys [max(input_start, kv_len - window),
        kv_len) (the pages before are never read; the engine may have freed them), inputs before that get 0
        (torch and numba backends).
    sinks: (H,) per-head sink logits in the softmax's denominator only (gpt-oss): a row's probabilities over
        its keys sum to less than 1 (torch and numba backends; not with lse).
    softcap: logits capped to softcap * tanh(s / softcap) before the softmax (Gemma 2's
        attn_logit_softcapping; torch and numba backends; lse, if given, over the capped logits).
    Returns float32 (B, N_max) or (B, R, N_max), equal to ops.macs_pool on the item's keys laid out
    contiguously.
    """
    MacsConfig(pooling=pooling, redistribute=redistribute, backend=backend)
    check_paged(q, k_pages, block_table)
    page_size = k_pages.shape[1]
    block, ranges, lse, out = row_arguments(
        q, block_table.shape[1] * page_size, input_start, input_end, kv_len, lse, out
    )
    check_pages_in_use(block_table, ranges[2], page_size, k_pages.shape[0])
    # Page numbers fit int32, the type paged-attention kernels take; int64 tables are converted once here.
    block_table = block_table.to(torch.int32)
    rows_out = out.view(block.shape[0], block.shape[2], out.shape[-1])
    arguments = (block, k_pages, block_table, rows_out, *ranges, as_scale(scale), pooling, bool(redistribute), lse)
    if window is None and sinks is None and softcap is None:
        kernel(backend, q.device, "macs_pool_paged")(*arguments)
        return out
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (a sliding window's length in keys), got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and 0 < softcap < float("inf")):
        raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (q.shape[1],):
            raise ValueError(f"sinks must be a ({q.shape[1]},) tensor of per-head sink logits (q's heads)")
        if lse is not None:
            raise ValueError("lse cannot be given with sinks: the kernel computes its own normaliser")
    name = resolve_backend(backend, q.device, "macs_pool_paged")
    if name not in VARIANT_FORMS:
        raise NotImplementedError(f"macs_pool_paged with a window, sinks or a softcap runs on the "
                                  f"{' and '.join(VARIANT_FORMS)} backends, not {name}")
    VARIANT_FORMS[name](*arguments, window=window, sinks=sinks, softcap=softcap)
    return out


def _torch_variant(q, k_pages, block_table, out, input_start, input_end, kv_len, scale, pooling, redistribute, lse,
                   *, window, sinks, softcap):
    keys = torch_backend.gather_pages(k_pages, block_table, int(kv_len.max()))
    torch_backend.macs_pool_variant(q, keys, out, input_start, input_end, kv_len, scale, pooling, redistribute, lse,
                                    window=window, sinks=sinks, softcap=softcap)


def _numba_variant(*arguments, window, sinks, softcap):
    from .numba.macs_pool_paged import macs_pool_paged as numba_form

    numba_form(*arguments, window=window, sinks=sinks, softcap=softcap)


# The backends whose paged op takes a sliding window, sinks and a softcap.
VARIANT_FORMS = {"torch": _torch_variant, "numba": _numba_variant}

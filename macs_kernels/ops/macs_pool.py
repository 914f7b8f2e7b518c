"""macs_pool: MACS's head-pooled row m' before the floor, for R query rows per sequence, each row with its
own key range (decode, verify blocks of assisted decoding, packed requests)."""
from __future__ import annotations

import torch

from macs_kernels.ops._checks import (
    IndexLike,
    as_row_index,
    as_scale,
    check_lse,
    check_options,
    check_paged,
    check_pages_in_use,
    check_q_k,
    check_ranges,
    values_readable,
)
from macs_kernels.ops.library import define_operator
from macs_kernels.ops.registry import kernel
from macs_kernels.ops.torch import backend as torch_backend
from macs_kernels.ops.variant import Variant, of_arguments

operator = define_operator(torch_backend.macs_pool, mutates_args=("out",))


def macs_pool(
    q: torch.Tensor, k_cache: torch.Tensor, *, input_start: IndexLike, input_end: IndexLike, kv_len: IndexLike,
    scale: float, pooling: str = "max", redistribute: bool = True, lse: torch.Tensor | None = None,
    out: torch.Tensor | None = None, backend: str | None = None, window: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None, key_offset: int = 0,
    block_table: torch.Tensor | None = None, variant: Variant | None = None, validate: bool | None = None,
) -> torch.Tensor:
    """MACS's head-pooled row m' of each query row, before the floor: the per-layer quantity that the tracer
    combines over layers (and, under tensor parallelism, over ranks) before taking the floor and the log.

    q: (B, H, D), one row per sequence, or (B, H, R, D), R rows per sequence (a verify pass of assisted
        decoding, packed requests).
    k_cache: (B, H_kv, S, D); with block_table, the pages (P, page_size, H_kv, D) of a paged cache (see
        block_table).
    input_start, input_end, kv_len: (B,) or (B, R) (a (B,) range applies to every row of item b). Row
        (b, r) attends keys [input_start, kv_len) of item b; [input_start, input_end) are its N inputs,
        [input_end, kv_len) generated tokens whose attention is spread evenly over the inputs when
        `redistribute`.
    lse: optional (B, H) or (B, H, R) natural-log log-sum-exp over each row's attended keys.
    out: optional float32 (B, N_max) or (B, R, N_max) buffer (q's rank minus one), written and returned; without
        it N_max is the largest N, read on the host (a sync on a GPU; pass out inside torch.compile or a CUDA graph).
    window, softcap, sinks, key_offset: the layer's attention variant, optional arguments as in
        flash_attn_with_kvcache (torch, triton and cuda backends; numba's paged kernel too; another backend is
        refused before work, naming it). The ranges are then token positions and p the variant's probabilities:
        - window: a sliding-window layer: each row attends only tokens [max(input_start, kv_len - window),
          kv_len); inputs before that get 0 before the spread;
        - key_offset: the token that key slot 0 holds (a sliding-window cache drops the tokens that slid out);
          0 with block_table, whose pages hold every token at its position;
        - softcap: logits capped to softcap * tanh(s / softcap) before the softmax (Gemma 2);
        - sinks: (H,) per-head sink logits in the softmax's denominator only (gpt-oss): a row's probabilities over
          its keys sum to less than 1.
        lse cannot be given with a variant (with block_table: with sinks).
    variant: the same four as one `ops.Variant` (what an engine holds per layer); not with them.
    block_table: (B, pages) int32 or int64, for a paged cache (transformers' continuous batching, vLLM,
        flash_attn_with_kvcache's `block_table`): key j of item b lies in page block_table[b, j // page_size] at
        slot j % page_size, keys numbered 0 .. pages * page_size - 1 per item. Entries past an item's last attended
        page, and before a window's first, are never read (-1 is fine there). ops.macs_pool_paged is this call.
    validate: check the index values (and the table's pages in use) (None: only where free, i.e. CPU tensors; True:
        always, one host sync on a GPU; False: never; see docs/api.md, "Argument checks").
    Returns float32 (B, N_max) or (B, R, N_max): m'[b, r, i] = pool over heads of (p[h, input_start + i] +
    the row's mass on generated keys / N) for i < N of that row, 0 after. N_max defaults to the largest N.
    """
    variant = of_arguments(variant, window, key_offset, softcap, sinks)
    check_options(pooling=pooling, redistribute=redistribute, backend=backend)
    if block_table is not None:
        return _paged(q, k_cache, block_table, input_start, input_end, kv_len, scale, pooling, redistribute, lse,
                      out, backend, variant, validate)
    check_q_k(q, k_cache, q_dims=q.dim() if isinstance(q, torch.Tensor) and q.dim() in (3, 4) else 3)
    keys = k_cache.shape[2]
    if not variant.plain:
        if lse is not None:
            raise ValueError("lse cannot be given with a variant: the kernel computes its own normaliser")
        single = q.dim() == 3
        index = [as_row_index(n, v, q.shape[0], None if single else q.shape[2], q.device)
                 for n, v in (("input_start", input_start), ("kv_len", kv_len))]
        keys = variant.check(q.shape[1], *index, keys, validate)
    ranges, lse, out = row_arguments(q, keys, input_start, input_end, kv_len, lse, out, validate)
    _run(kernel(backend, q.device, "macs_pool", variant), (q, k_cache), out, ranges, scale, pooling, redistribute,
         lse, variant)
    return out


def _paged(q, k_pages, block_table, input_start, input_end, kv_len, scale, pooling, redistribute, lse, out, backend,
           variant, validate):
    """macs_pool over the pages of a paged cache read through block_table (macs_pool_paged's kernels)."""
    check_paged(q, k_pages, block_table)
    if not (isinstance(variant.key_offset, int) and variant.key_offset == 0):
        raise ValueError(f"a paged cache holds every token at its position: key_offset must be 0, got "
                         f"{variant.key_offset!r}")
    if variant.sinks is not None and lse is not None:
        raise ValueError("lse cannot be given with sinks: the kernel computes its own normaliser")
    page_size = k_pages.shape[1]
    ranges, lse, out = row_arguments(
        q, block_table.shape[1] * page_size, input_start, input_end, kv_len, lse, out, validate
    )
    if not variant.plain:
        variant.check(q.shape[1], ranges[0], ranges[2], block_table.shape[1] * page_size, validate)
    check_pages_in_use(block_table, lambda: torch_backend.window_start(ranges[0], ranges[2], variant.window),
                       ranges[2], page_size, k_pages.shape[0], validate)
    # Page numbers fit int32, the type paged-attention kernels take; int64 tables are converted once here.
    _run(kernel(backend, q.device, "macs_pool_paged", variant), (q, k_pages, block_table.to(torch.int32)), out,
         ranges, scale, pooling, redistribute, lse, variant)
    return out


def _run(run, keys, out, ranges, scale, pooling, redistribute, lse, variant):
    """One launch of a pooled-row kernel: `keys` its leading arguments (the query rows and the keys, with the block
    table of a paged cache), ranges in token positions (converted to key slots for a variant)."""
    extra = {}
    if not variant.plain:
        ranges, extra = variant.key_slots(*ranges)
    run(*keys, out, *ranges, as_scale(scale), pooling, bool(redistribute), lse, **extra)


def row_arguments(q, keys, input_start, input_end, kv_len, lse, out, validate=None):
    """The checked arguments of a pooled-row op whose items hold `keys` key slots, in q's layout (the kernels take
    one row per item, q (B, H, D), and blocks of rows, q (B, H, R, D): _checks.as_row_block): the three ranges (B,)
    or (B, R), lse (B, H[, R]) or None, and `out` (given, checked, or allocated) in q's rank minus one."""
    single_row = q.dim() == 3
    batch, heads = q.shape[:2]
    rows = 1 if single_row else q.shape[2]
    ranges = [
        as_row_index(name, value, batch, None if single_row else rows, q.device)
        for name, value in (("input_start", input_start), ("input_end", input_end), ("kv_len", kv_len))
    ]
    expected_rank = 2 if single_row else 3
    if out is not None and (not isinstance(out, torch.Tensor) or out.dim() != expected_rank):
        raise ValueError(f"out must be a float32 tensor with {expected_rank} dimensions (q's rank minus one)")
    check_ranges(*ranges, keys, None if out is None else out.shape[-1], state="out", validate=validate)
    if out is None:
        values_readable("out", q)
    n_max = int((ranges[1] - ranges[0]).max()) if out is None else out.shape[-1]
    if lse is not None:
        check_lse(lse, (batch, heads) if single_row else (batch, heads, rows), q.device)
    expected = (batch, n_max) if single_row else (batch, rows, n_max)
    if out is None:
        out = torch.empty(expected, dtype=torch.float32, device=q.device)
    elif tuple(out.shape) != expected or out.dtype != torch.float32 or out.device != q.device \
            or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {expected} on {q.device}")
    return ranges, lse, out

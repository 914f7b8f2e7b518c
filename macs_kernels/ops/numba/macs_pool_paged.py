"""macs_pool_paged on CPUs, compiled by numba: each scored row's keys are read in place through the block
table, one pass per (row, KV head) that scores, normalises, spreads and pools over heads, with no gathered
copy of the pages. The torch form gathers the attended pages of every layer into one tensor first: on a
serving engine's decode passes that copy costs more than the arithmetic.

Both of vLLM's CPU key layouts are read at vector speed: slots at unit stride (its `vec` ISA stores each
key block [D, block_size]) and dims at unit stride (plain pages, FLASH_ATTN's layout). The kernel runs on the
calling thread and releases the GIL.
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba.core import caching

from macs_kernels.ops._checks import as_row_block

_POOLINGS = {"max": 0, "mean": 1, "min": 2}
_LOG2E, _LN2_HIGH, _LN2_LOW = 1.44269504088896341, 0.693359375, -2.12194440e-4


class _UserCacheImpl(caching.CompileResultCacheImpl):
    # numba's own choice for a source tree it cannot write (its user-wide cache directory; NUMBA_CACHE_DIR where
    # set), never the package's folder, which numba would write into by default (an installed package's files).
    _locator_classes = [caching.UserProvidedCacheLocator, caching.UserWideCacheLocator]


class _UserCache(caching.FunctionCache):
    _impl_class = _UserCacheImpl


def _compiled(function):
    """numba.njit(nogil, fastmath) of `function`, its machine code cached in the user's cache directory (compiling
    a kernel takes seconds, once per signature); without a writable one, compiled once per process."""
    kernel = numba.njit(nogil=True, fastmath=True)(function)
    try:
        kernel._cache = _UserCache(function)  # what njit(cache=True) sets, with numba's in-tree locator left out
    except RuntimeError:  # no cache directory numba can write
        pass
    return kernel


@_compiled
def _exp_in_place(x, bits):
    """x <- exp(x) for x <= 0 (float32), Cephes' expf split so that every loop vectorizes: libm's exp is a
    scalar call per element, which would cost more than the scores. bits: an int32 scratch as long as x."""
    for i in range(x.shape[0]):
        value = max(x[i], np.float32(-87.0))
        k = math.floor(value * np.float32(_LOG2E) + np.float32(0.5))
        r = value - k * np.float32(_LN2_HIGH) - k * np.float32(_LN2_LOW)
        p = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        p = (p * r * r + r + np.float32(1.0)) if x[i] > np.float32(-87.0) else np.float32(0.0)
        x[i] = p
        bits[i] = (np.int32(k) + np.int32(127)) << 23
    powers = bits.view(np.float32)
    for i in range(x.shape[0]):
        x[i] *= powers[i]


@_compiled
def _row_range(attend_start, input_start, input_end, kv_len, keys):
    """(attend, start, end, length) of a row: keys [attend, length), inputs [start, end) (start at or before attend: a
    window's inputs). Clamped into the item's `keys` keys as the cuda kernels clamp them (csrc/common.cuh, KeyRange;
    csrc/pool/kernel.cuh): an unchecked range gives wrong numbers, never an access outside the arrays (numba checks
    no bounds)."""
    length = min(max(kv_len, 0), keys)
    attend = min(max(attend_start, 0), length)
    start = min(input_start, attend)
    return attend, start, min(max(input_end, start), length), length


@_compiled
def _macs_pool_paged_kernel(q, keys, strides, table, out, attend_start, input_start, input_end, kv_len, scale,
                            pooling, redistribute, lse, has_lse, sinks, has_sinks, softcap):
    batch, heads, rows, dim = q.shape
    page_stride, slot_stride, head_stride, dim_stride, page_size, kv_heads, pages = strides
    group = heads // kv_heads
    item_keys = table.shape[1] * page_size
    width = out.shape[2]
    longest = 1
    for b in range(batch):
        for r in range(rows):
            _, start, _, length = _row_range(attend_start[b, r], input_start[b, r], input_end[b, r], kv_len[b, r],
                                             item_keys)
            longest = max(longest, length - start)
    scores = np.empty((group, longest), dtype=np.float32)
    bits = np.empty(longest, dtype=np.int32)
    for b in range(batch):
        for r in range(rows):
            # A sliding-window layer's row attends from its window's start: the input slots before (skip of
            # them) get probability 0 and their pages are never read (the engine may have freed them).
            attend, start, end, length = _row_range(attend_start[b, r], input_start[b, r], input_end[b, r],
                                                    kv_len[b, r], item_keys)
            n_input, span = end - start, length - start
            columns = min(n_input, width)  # only an unchecked input range is longer than the row
            skip = attend - start
            pooled = out[b, r]
            if length == attend:  # an unchecked range that attends no key: no softmax, a row of zeros
                pooled[:] = 0.0
                continue
            fill = -np.inf if pooling == 0 else (np.inf if pooling == 2 else 0.0)
            pooled[:columns] = fill
            pooled[columns:] = 0.0
            for kv_head in range(kv_heads):
                for page_index in range(attend // page_size, (length - 1) // page_size + 1):
                    page_start = page_index * page_size
                    low, high = max(attend, page_start) - page_start, min(length, page_start + page_size) - page_start
                    # A page outside the pages comes only from an unchecked table: clamped into them, as cuda does.
                    page = min(max(table[b, page_index], 0), pages - 1)
                    base = page * page_stride + kv_head * head_stride
                    offset = page_start - start
                    # Loops index views from 0 (computed indices would make numba wrap negative ones, element
                    # by element, which keeps LLVM from vectorizing).
                    count = high - low
                    if slot_stride == 1:  # vLLM's CPU `vec` layout: a page holds each dim's slots in a row
                        for g in range(group):
                            scores[g, offset + low:offset + high] = 0.0
                        for d in range(dim):
                            row = keys[base + d * dim_stride + low:base + d * dim_stride + high]
                            for g in range(group):
                                weight = q[b, kv_head * group + g, r, d] * scale
                                target = scores[g, offset + low:offset + high]
                                for i in range(count):
                                    target[i] += weight * row[i]
                    else:
                        for i in range(count):
                            first = base + (low + i) * slot_stride
                            key = keys[first:first + (dim - 1) * dim_stride + 1:dim_stride]
                            for g in range(group):
                                query_row = q[b, kv_head * group + g, r]
                                total = np.float32(0.0)
                                for d in range(dim):
                                    total += query_row[d] * key[d]
                                scores[g, offset + low + i] = total * scale
                for g in range(group):
                    head = kv_head * group + g
                    row_scores = scores[g, :span]
                    attended = scores[g, skip:span]
                    if softcap > 0:  # Gemma 2's cap on the logits
                        for t in range(span - skip):
                            attended[t] = softcap * math.tanh(attended[t] / softcap)
                    if has_lse:
                        shift = lse[b, head, r]
                    else:
                        shift = attended[0]
                        for t in range(1, span - skip):
                            shift = max(shift, attended[t])
                        if has_sinks:  # the sink logit is in the softmax's denominator only
                            shift = max(shift, sinks[head])
                    for t in range(span - skip):
                        attended[t] -= shift
                    _exp_in_place(attended, bits[:span - skip])
                    row_scores[:skip] = 0.0
                    norm = np.float32(1.0)
                    if not has_lse:
                        norm = np.float32(0.0)
                        for t in range(span - skip):
                            norm += attended[t]
                        if has_sinks:
                            norm += np.float32(math.exp(sinks[head] - shift))
                    spill = np.float32(0.0)
                    if redistribute and n_input > 0:
                        for t in range(n_input, span):
                            spill += row_scores[t]
                        spill /= n_input
                    inverse = np.float32(1.0) / norm
                    if pooling == 0:
                        for j in range(columns):
                            pooled[j] = max(pooled[j], (row_scores[j] + spill) * inverse)
                    elif pooling == 2:
                        for j in range(columns):
                            pooled[j] = min(pooled[j], (row_scores[j] + spill) * inverse)
                    else:
                        for j in range(columns):
                            pooled[j] += (row_scores[j] + spill) * inverse
            if pooling == 1:
                for j in range(columns):
                    pooled[j] /= heads


def _flat(tensor: torch.Tensor) -> tuple[np.ndarray, tuple[int, ...]]:
    """A 1-D numpy view over the storage `tensor` spans, and its strides in elements (no copy)."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return torch.as_strided(tensor, (span,), (1,), tensor.storage_offset()).numpy(), tensor.stride()


def macs_pool_paged(q, k_pages, block_table, out, input_start, input_end, kv_len, scale, pooling, redistribute,
                    lse, score_start=None, softcap=None, sinks=None):
    """q (B, H, R, D), k_pages (P, page_size, H_kv, D) any strides, block_table (B, pages) int32, ranges
    (B, R) int32 or int64 (any strides), out (B, R, N_max) float32 written; lse (B, H, R) or None; score_start
    (B, R), softcap, sinks (H,): the layer's attention variant in key slots, as torch_backend.macs_pool takes it (a
    sliding-window row attends from input_start, its inputs start at score_start). One row per item: q (B, H, D),
    ranges (B,), out (B, N_max), lse (B, H)."""
    q, out, lse, input_start, input_end, kv_len, score_start = as_row_block(
        q, out, lse, input_start, input_end, kv_len, score_start)
    if k_pages.dtype != torch.float32:
        # Numba has no bfloat16: the attended pages are gathered in float32 (a copy), under a table that
        # numbers them in that order.
        counts = (kv_len.amax(dim=1) + k_pages.shape[1] - 1) // k_pages.shape[1]
        used = torch.arange(block_table.shape[1]) < counts[:, None]
        # Entries before a window may name freed pages (-1): clamped into range, never read.
        k_pages = k_pages.index_select(0, block_table[used].long().clamp(0, k_pages.shape[0] - 1)).float()
        block_table = torch.zeros_like(block_table).masked_scatter_(used, torch.arange(int(used.sum()),
                                                                                       dtype=block_table.dtype))
    keys, (page_stride, slot_stride, head_stride, dim_stride) = _flat(k_pages)
    strides = np.array([page_stride, slot_stride, head_stride, dim_stride, k_pages.shape[1], k_pages.shape[2],
                        k_pages.shape[0]])
    target = out if out.is_contiguous() else torch.empty_like(out)
    lse_array = np.zeros((1, 1, 1), np.float32) if lse is None else lse.float().contiguous().numpy()
    inputs = input_start if score_start is None else score_start.contiguous()
    _macs_pool_paged_kernel(q.float().contiguous().numpy(), keys, strides, block_table.numpy(), target.numpy(),
                            input_start.numpy(), inputs.numpy(), input_end.numpy(), kv_len.numpy(),
                            np.float32(scale), _POOLINGS[pooling], bool(redistribute), lse_array, lse is not None,
                            np.zeros(1, np.float32) if sinks is None else sinks.float().contiguous().numpy(),
                            sinks is not None, np.float32(0.0 if softcap is None else softcap))
    if target is not out:
        out.copy_(target)

"""Vectorised PyTorch implementations of the ops: they run on any device, and each is its operator's
default kernel (ops/<op>.py declares `torch.ops.macs_kernels.<op>` from the function's type hints).

Arguments arrive validated and positional in the operator's order; index tensors are (B,) (macs_pool:
(B, R), possibly a (B,) broadcast with stride 0) int32 or int64 on the data's device, as the caller held them.
Nothing here materialises more than one (B, H, S) row block per call: the O(S^2) attention matrix
never exists.

The row's formulas (scores, the variant, the softmax, the output, the spread, the pooling, the floor) are
torch_row's; this module supplies the layouts of a batch-major cache: per-row ranges, the dense fast paths and a
paged cache gathered into one block.
"""
from __future__ import annotations

import torch
from torch import Tensor

from macs_kernels.ops._checks import as_row_block, host_readable
from macs_kernels.ops.torch.row import POOLS as _POOL
from macs_kernels.ops.torch.row import (
    attended_softmax,
    grouped_output,
    grouped_scores,
    log_floor,
    pooled_inputs,
    softmax,
    spread,
)
from macs_kernels.ops.torch.row import (  # re-exported for the modules that take them from here
    window_ranges as window_ranges,
)
from macs_kernels.ops.torch.row import (
    window_start as window_start,
)


def _column(index: torch.Tensor) -> torch.Tensor:
    return index.view(-1, 1)


def macs_update_rows(
    rows: Tensor, log_c: Tensor, input_start: Tensor, input_end: Tensor, kv_len: Tensor, alpha: float, pooling: str,
    redistribute: bool,
) -> None:
    pooled, past_inputs = pooled_inputs(rows.float(), input_start, input_end, kv_len, log_c.shape[1], pooling,
                                        redistribute)
    log_c.add_(log_floor(pooled, alpha).masked_fill_(past_inputs, 0.0))


def macs_pool_dense(q, k_cache, out, *, n_input, scale, pooling, redistribute):
    """`macs_pool` when keys [0, n_input) are every item's inputs (an unpadded batch with a growing cache) and
    the rows attend every slot causally: one row per item (q (B, H, D), out (B, N_max)) attends [0, S); a block
    of R rows (q (B, H, R, D), out (B, R, N_max), an assisted-decoding verify pass) has row r attend
    [0, S - R + 1 + r). n_input is a Python int, so there is no gather and no host sync: about a third of the
    general path's kernel launches, which is what a decode step pays per layer on a CPU."""
    _pool_dense_rows(_dense_rows(q, k_cache, scale), out, n_input, pooling, redistribute)


def _dense_rows(q, k_cache, scale):
    """Softmax rows (B, H, [R,] S) float32 of `macs_pool_dense`'s causal ranges."""
    scores = grouped_scores(q, k_cache, scale)
    rows, keys = (q.shape[2] if q.dim() == 4 else 1), k_cache.shape[2]
    if rows > 1:  # only the last R - 1 keys lie past some row's range: mask that (R, R - 1) corner
        past_range = torch.ones(rows, rows - 1, dtype=torch.bool, device=q.device).triu_()
        scores[..., keys - rows + 1:].masked_fill_(past_range, float("-inf"))
    return softmax(scores)


def _pool_dense_rows(rows, out, n_input, pooling, redistribute):
    """Rows (B, H, [R,] S) of keys whose first n_input are the inputs -> m' into out (B, [R,] N_max)."""
    # A decode step pays per kernel launch on a CPU: the spread (an int n_input) and the pooling (out=) are one
    # kernel each.
    inputs = rows[..., :n_input]
    if redistribute and rows.shape[-1] > n_input:
        inputs = spread(inputs, rows[..., n_input:].sum(dim=-1, keepdim=True), n_input)
    _POOL[pooling](inputs, out=out[..., :n_input])
    if out.shape[-1] > n_input:
        out[..., n_input:].zero_()


def decode_attention_dense(q, k_cache, v_cache, pooled, *, n_input, scale, pooling, redistribute):
    """`decode_attention` writing `macs_pool_dense`'s m' into pooled under its conditions, one row per item
    (q (B, H, D) -> (B, H, D)) or a causal block (q (B, H, R, D) -> (B, H, R, D)): K is read once."""
    rows = _dense_rows(q, k_cache, scale)
    _pool_dense_rows(rows, pooled, n_input, pooling, redistribute)
    return grouped_output(rows, v_cache, q.dtype)


def macs_update(
    q: Tensor, k_cache: Tensor, log_c: Tensor, input_start: Tensor, input_end: Tensor, kv_len: Tensor, scale: float,
    alpha: float, pooling: str, redistribute: bool, lse: Tensor | None,
) -> None:
    scores = grouped_scores(q, k_cache, scale)
    probabilities, _ = attended_softmax(scores, input_start, kv_len, lse)
    macs_update_rows(probabilities, log_c, input_start, input_end, kv_len, alpha, pooling, redistribute)


def macs_pool(
    q: Tensor, k_cache: Tensor, out: Tensor, input_start: Tensor, input_end: Tensor, kv_len: Tensor, scale: float,
    pooling: str, redistribute: bool, lse: Tensor | None, score_start: Tensor | None = None,
    softcap: float | None = None, sinks: Tensor | None = None,
) -> None:
    """q (B, H, R, D), ranges (B, R), out (B, R, N_max), lse (B, H, R); or one row per item: q (B, H, D), ranges
    (B,), out (B, N_max), lse (B, H). See ops.macs_pool.

    The layer's attention variant, in key slots (what ops.Variant.key_slots makes of a window and key_offset):
    the row attends [input_start, kv_len) and its N inputs are [score_start, input_end) (default input_start; a
    sliding window starts later than its inputs, which may precede slot 0); softcap; sinks (H,)."""
    q, out, lse, input_start, input_end, kv_len, score_start = as_row_block(
        q, out, lse, input_start, input_end, kv_len, score_start)
    scores = grouped_scores(q, k_cache, scale)
    probabilities, _ = attended_softmax(scores, input_start, kv_len, lse, softcap=softcap, sinks=sinks)
    _pool_rows(probabilities, out, input_start, score_start, input_end, kv_len, pooling, redistribute)


def _pool_rows(probabilities, out, attend_start, score_start, input_end, kv_len, pooling, redistribute):
    """m' of rows (B, H, [R,] S) over ranges (B, [R]) into out (B, [R,] N_max), 0 past each row's N. The inputs
    are [score_start, input_end) when score_start is given (a sliding window's: slots before 0, tokens the cache
    dropped, get 0), else [attend_start, input_end)."""
    windowed = score_start is not None
    pooled, past_inputs = pooled_inputs(probabilities, score_start if windowed else attend_start, input_end, kv_len,
                                        out.shape[-1], pooling, redistribute, windowed)
    out.copy_(pooled.masked_fill_(past_inputs, 0.0))


def gather_pages(k_pages: Tensor, block_table: Tensor, keys: int) -> Tensor:
    """The first `keys` keys of each item from a paged cache: k_pages (P, page_size, H_kv, D) and block_table
    (B, pages) (key j of item b in page block_table[b, j // page_size], slot j % page_size) -> (B, H_kv,
    keys, D). Entries past an item's keys may be anything (-1 for unused): only the pages that hold one of
    the first `keys` keys are read, and those of a shorter item are clamped into range (their keys are
    never attended)."""
    page_size = k_pages.shape[1]
    used = block_table[:, : -(-keys // page_size)].long().clamp(0, k_pages.shape[0] - 1)
    pages = k_pages[used]  # (B, pages, page_size, H_kv, D)
    return pages.flatten(1, 2)[:, :keys].transpose(1, 2)


def macs_pool_paged(
    q: Tensor, k_pages: Tensor, block_table: Tensor, out: Tensor, input_start: Tensor, input_end: Tensor,
    kv_len: Tensor, scale: float, pooling: str, redistribute: bool, lse: Tensor | None,
    score_start: Tensor | None = None, softcap: float | None = None, sinks: Tensor | None = None,
) -> None:
    """macs_pool over a paged cache: the pages the rows attend, gathered into one (B, H_kv, S, D) block
    (S = the longest row's kv_len), then macs_pool (score_start, softcap, sinks: the layer's variant as
    macs_pool takes it)."""
    # The longest row's keys when its length can be read for free; else every key the table reaches (no sync).
    if not host_readable(kv_len):
        keys = block_table.shape[1] * k_pages.shape[1]
    else:
        keys = int(kv_len.max()) if kv_len.numel() else 0
    macs_pool(q, gather_pages(k_pages, block_table, keys), out, input_start, input_end, kv_len, scale, pooling,
              redistribute, lse, score_start, softcap, sinks)


def macs_zscore(log_c: Tensor, n_input: Tensor) -> Tensor:
    n_max = log_c.shape[1]
    valid = torch.arange(n_max, device=log_c.device) < _column(n_input)
    masked = log_c.masked_fill(~valid, float("-inf"))
    top = masked.amax(dim=1, keepdim=True)
    # z is invariant to scaling c; a row of -inf (all attention underflowed) has no finite top.
    c = torch.exp(masked - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    count = _column(n_input).clamp_min(1).to(c.dtype)
    mean = c.sum(dim=1, keepdim=True) / count
    centred = (c - mean).masked_fill_(~valid, 0.0)
    std = torch.sqrt(centred.square().sum(dim=1, keepdim=True) / count)
    return torch.where(std > 0, centred / std, torch.zeros_like(centred))


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_start: Tensor, kv_len: Tensor, scale: float, log_c: Tensor | None,
    input_end: Tensor | None, alpha: float, pooling: str, redistribute: bool, pooled: Tensor | None,
    score_start: Tensor | None = None, softcap: float | None = None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """See ops.decode_attention; score_start, softcap, sinks: the layer's attention variant in key slots, as
    macs_pool takes them (score_start with pooled only). The output is the layer's (sink mass attends no
    value).

    pooled has no default although it is optional: torch before 2.13 hands a Python kernel its arguments without
    the trailing ones equal to their defaults, and its ADInplaceOrView kernel of this mutating op then indexes the
    missing written argument (IndexError on every call that left pooled at None)."""
    if score_start is not None and log_c is not None:
        raise ValueError("decode_attention: score_start (a sliding window's input columns) comes with pooled, "
                         "not log_c")
    scores = grouped_scores(q, k_cache, scale)
    probabilities, lse = attended_softmax(scores, kv_start, kv_len, softcap=softcap, sinks=sinks)
    if log_c is not None and pooled is None:
        macs_update_rows(probabilities, log_c, kv_start, input_end, kv_len, alpha, pooling, redistribute)
    elif pooled is not None:
        _pool_rows(probabilities, pooled, kv_start, score_start, input_end, kv_len, pooling, redistribute)
    return grouped_output(probabilities, v_cache, q.dtype), lse

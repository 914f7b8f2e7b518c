"""Torch path of attention_features: row chunks of one layer's scores, reduced over rows before the gather."""
from __future__ import annotations

import torch
from torch import Tensor

from macs_kernels.ops.torch.row import attended_softmax, grouped_scores, window_start

# Rows per chunk: bounds the (B, H, rows, S) float32 block (64 rows x 8k keys x 9 heads = 19 MB per item).
ROW_CHUNK = 64


def attention_features(
    q: Tensor, k_cache: Tensor, source_start: Tensor, source_end: Tensor, kv_start: Tensor, kv_len: Tensor,
    n_rows: Tensor, n_max: int, scale: float, lse: Tensor | None, window: int | None = None,
    softcap: float | None = None, sinks: Tensor | None = None,
) -> Tensor:
    """window, softcap, sinks (H,): the layer's attention variant (`ops.Variant`); row r then attends
    [max(kv_start, end_r - window), end_r)."""
    batch, heads, rows, _ = q.shape
    keys = k_cache.shape[2]
    device = q.device
    # Row r's causal end, per item: the last valid row ends at kv_len.
    first_end = (kv_len - n_rows + 1).view(-1, 1, 1)
    keys_f = k_cache.float()  # once, not per chunk
    summed = torch.zeros(batch, heads, keys, dtype=torch.float32, device=device)
    for r0 in range(0, rows, ROW_CHUNK):
        r = torch.arange(r0, min(rows, r0 + ROW_CHUNK), device=device)
        chunk = len(r)
        scores = grouped_scores(q[:, :, r0:r0 + chunk], keys_f, scale)
        ends = first_end[:, :, 0] + r.view(1, -1)
        starts = window_start(kv_start.view(-1, 1), ends, window)
        valid = (r.view(1, -1) < n_rows.view(-1, 1))[:, None, :]
        # Rows r >= n_rows still attend a non-empty range here (kv_start < kv_len - n_rows + r + 1), so
        # their softmax is finite; they are zeroed afterwards (a given lse of +inf zeroes them directly).
        row_lse = None if lse is None else lse[:, :, r0:r0 + chunk].float().masked_fill(~valid, float("inf"))
        p, _ = attended_softmax(scores, starts.expand(batch, chunk), ends, row_lse, softcap=softcap, sinks=sinks)
        if lse is None:
            p.mul_(valid.unsqueeze(-1))
        summed += p.sum(dim=2)
    offsets = torch.arange(n_max, device=device)
    columns = (source_start.view(-1, 1) + offsets).clamp(0, keys - 1)
    features = summed.gather(2, columns[:, None, :].expand(batch, heads, n_max))
    inside = offsets < (source_end - source_start).view(-1, 1)
    return features.masked_fill_(~inside[:, None, :], 0.0)

"""Dense MACS rows of beam search on the torch backend: generate repeats each prompt once per beam and beam
search reorders only among a prompt's beams, so their input keys are copies; these read them once per prompt,
not once per beam. The layout only: the row's formulas are torch_row's."""
from __future__ import annotations

import torch

from macs_kernels.ops.torch.backend import _pool_dense_rows
from macs_kernels.ops.torch.row import grouped_output, grouped_queries, key_scores, softmax


def _by_prompt(rows: torch.Tensor, beams: int, kv_heads: int) -> torch.Tensor:
    """(B, H, X) -> (B / beams, H_kv, beams * H / H_kv, X): the rows of a prompt's beams that read one KV head,
    side by side (a copy)."""
    batch, heads, width = rows.shape
    grouped = rows.view(batch // beams, beams, kv_heads, heads // kv_heads, width).transpose(1, 2)
    return grouped.reshape(batch // beams, kv_heads, beams * heads // kv_heads, width)


def _by_beam(rows: torch.Tensor, beams: int) -> torch.Tensor:
    """`_by_prompt`'s layout back to one item per beam: (B / beams, beams, H_kv, H / H_kv, X) (a view)."""
    prompts, kv_heads, beam_heads, width = rows.shape
    return rows.view(prompts, kv_heads, beams, beam_heads // beams, width).transpose(1, 2)


def _beam_softmax(q, k_cache, n_input: int, beams: int, scale: float) -> torch.Tensor:
    """`macs_pool_dense`'s attention rows (B, H, S) float32 when each run of `beams` items shares its input
    keys [0, n_input): those are read once per run (from its first item), the generated keys once per item."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    grouped = grouped_queries(q, kv_heads, scale)  # (B, H_kv, G, D)
    shared = key_scores(_by_prompt(grouped.view(batch, heads, dim), beams, kv_heads), k_cache[::beams, :, :n_input])
    own = key_scores(grouped, k_cache[:, :, n_input:])
    scores = torch.cat([_by_beam(shared, beams), own.unflatten(0, (-1, beams))], dim=-1)
    return softmax(scores.view(batch, heads, -1))


def beam_pool_dense(q, k_cache, out, *, n_input, scale, pooling, redistribute, beams):
    """`macs_pool_dense` of one row per beam (q (B, H, 1, D), out (B, 1, N_max)) whose beams share their input
    keys (see `_beam_softmax`)."""
    _pool_dense_rows(_beam_softmax(q[:, :, 0], k_cache, n_input, beams, scale), out[:, 0], n_input,
                     pooling, redistribute)


def beam_decode_dense(q, k_cache, v_cache, pooled, *, n_input, scale, pooling, redistribute, beams):
    """`decode_attention_dense` of one row per beam (q (B, H, 1, D) -> (B, H, 1, D)) whose beams share their
    input keys and values: both read once per prompt."""
    rows = _beam_softmax(q[:, :, 0], k_cache, n_input, beams, scale)
    _pool_dense_rows(rows, pooled[:, 0], n_input, pooling, redistribute)
    batch, heads, _ = rows.shape
    kv_heads = v_cache.shape[1]
    # A prompt's beams side by side are query heads of one item: grouped_output reads each KV head's values once.
    by_prompt = _by_prompt(rows[..., :n_input], beams, kv_heads).flatten(1, 2)
    shared = grouped_output(by_prompt, v_cache[::beams, :, :n_input]).unflatten(1, (kv_heads, -1))
    own = grouped_output(rows[..., n_input:], v_cache[:, :, n_input:])
    own = own.view(batch // beams, beams, kv_heads, heads // kv_heads, -1)
    return (_by_beam(shared, beams) + own).reshape(batch, heads, 1, -1).to(q.dtype)
